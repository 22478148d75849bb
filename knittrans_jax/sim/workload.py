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


class PromptStream:
  """The data loader: each block of G prompts has exactly the quota mix, shuffled.

  Without quotas the mix is uniform over the configured sources.
  """

  def __init__(self, spec, sources, rng: np.random.Generator):
    if spec.source_quota is not None:
      block = [s for s, q in spec.source_quota.items() for _ in range(q)]
    else:
      names = list(sources)
      block = [names[i % len(names)] for i in range(spec.groups_per_batch)]
    self._block, self._rng, self._queue = block, rng, []

  def next(self) -> str:
    if not self._queue:
      self._queue = [str(s) for s in self._rng.permutation(self._block)][::-1]
    return self._queue.pop()

  def state(self) -> dict:
    """JSON-able: the rest of the current block and the generator's state."""
    return {"queue": list(self._queue), "rng": self._rng.bit_generator.state}

  def restore(self, state: dict) -> None:
    self._queue = list(state["queue"])
    self._rng.bit_generator.state = state["rng"]
