"""Learning-quality studies: a grid of job configurations x seeds, and its statistics."""
