"""The fleet on Ray (JobConfig.cluster = 'ray'): connecting, rollout actors, trainer
actors. Nothing here is imported by a local run, so Ray is needed only for this."""
