"""Held-out evaluation of the current policy (not of the stale samples it trains on).

Every `EvalConfig.every_steps` optimizer steps (and after the last one) the trainer
process generates one response per held-out prompt with the current weights, greedy
and sampled, and scores them with the suite's reward. The prompts are the same for
every configuration of a study: tasks drawn with `seed + seed_offset` (the synthetic
and vision suites), or the math suite's prompt for held-out group ids (from 2^31,
which training never reaches; the math prompt file itself has no held-out split).
"""
from __future__ import annotations

import dataclasses

import gin
import jax
import numpy as np

from knittrans_jax.rollout.groups import rollout_groups

HELD_OUT = 1 << 31  # group ids are folded into uint32 sampling keys


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """every_steps: 0 turns evaluation off. prompts_per_source: held-out prompts per source."""
  every_steps: int = 0
  prompts_per_source: int = 16
  seed_offset: int = 1_000_003

  def __post_init__(self):
    if self.every_steps < 0 or self.prompts_per_source <= 0:
      raise ValueError(f"EvalConfig: every_steps {self.every_steps} >= 0 and prompts_per_source "
                       f"{self.prompts_per_source} > 0 are required")


class Evaluator:

  def __init__(self, config: EvalConfig, graphdef, sampler, suite: str, sources, seed: int,
               image_size: int = 0, math=None):
    self.config, self.graphdef, self.suite = config, graphdef, suite
    self.image_size, self.math = image_size, math
    self.seed = seed + config.seed_offset
    # Held-out group ids start at 2^31, far above any id training dispatches.
    self.requests = [(HELD_OUT + k * len(sources) + i, s) for i, s in enumerate(sources)
                     for k in range(config.prompts_per_source)]
    self.samplers = {"greedy": dataclasses.replace(sampler, greedy=True),
                     "sampled": dataclasses.replace(sampler, greedy=False)}

  def due(self, step: int, last: int) -> bool:
    every = self.config.every_steps
    return bool(every) and (step % every == 0 or step == last)

  def __call__(self, params, version: int) -> dict:
    out = {}
    for name, sampler in self.samplers.items():
      groups = rollout_groups(self.graphdef, params, version, self.seed, self.requests, 1,
                              sampler, self.suite, self.image_size, self.math)
      out[name] = float(np.mean([g.trajectories[0].reward for g in groups]))
    return out
