"""Response lengths and the prompt stream the dispatcher draws from."""
from __future__ import annotations

import numpy as np

from knittrans_jax.sim.config import SimConfig, SourceModel


def sample_lengths(rng: np.random.Generator, model: SourceModel, n: int) -> np.ndarray:
  if model.dist == "lognormal":
    raw = model.median * np.exp(model.sigma * rng.standard_normal(n))
  else:
    raw = model.scale * (1.0 + rng.pareto(model.alpha, n))
  return np.clip(np.rint(raw), 1, model.max_tokens).astype(np.int64)


class LengthSampler:
  """Draws response lengths in blocks per source (fast), in a seeded order."""

  def __init__(self, config: SimConfig, rng: np.random.Generator, block: int = 4096):
    self._config, self._rng, self._block = config, rng, block
    self._buf = {s: [] for s in config.sources}

  def take(self, source: str, n: int) -> list[int]:
    buf = self._buf[source]
    if len(buf) < n:
      buf += sample_lengths(self._rng, self._config.sources[source], self._block).tolist()
    out = buf[-n:]
    del buf[-n:]
    return out

