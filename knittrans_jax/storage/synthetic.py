"""Random, seeded trajectories for tests, the store demo and benchmarks.

Not a task generator (that is rollout/): only shapes and dtypes that look like
real rollouts, with long-tailed response lengths.
"""
from __future__ import annotations

import numpy as np

from knittrans_jax.types import Trajectory


def random_group(rng: np.random.Generator, group_id: int, n: int, source: str,
                 prompt_len: int = 64, response_len_median: int = 256,
                 response_len_sigma: float = 0.6, max_response_len: int = 2048,
                 vocab: int = 32000, version: int = 0,
                 image_ids: tuple[str, ...] = ()) -> list[Trajectory]:
  """n responses to one prompt: shared prompt tokens and images, lognormal lengths."""
  prompt = rng.integers(0, vocab, prompt_len, dtype=np.int32)
  lengths = np.clip(rng.lognormal(np.log(response_len_median), response_len_sigma, n),
                    1, max_response_len).astype(int)
  out = []
  for i, length in enumerate(lengths):
    out.append(Trajectory(
        prompt_tokens=prompt,
        response_tokens=rng.integers(0, vocab, length, dtype=np.int32),
        logprobs=-rng.exponential(1.0, length).astype(np.float32),
        loss_mask=np.ones(length, bool),
        reward=float(rng.random()),
        source=source, group_id=group_id, index_in_group=i,
        versions=(version,), image_ids=image_ids))
  return out
