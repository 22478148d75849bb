"""Held-out evaluation of the current policy (not of the stale samples it trains on).

Every `EvalConfig.every_steps` optimizer steps (and after the last one) the trainer
process generates one response per held-out prompt with the current weights, greedy
and sampled, and scores them with the suite's reward. The prompts are the same for
every configuration of a study: tasks drawn with `seed + seed_offset` for group ids
from 2^31, which training never reaches, and only from the held-out side of the
split of each source's prompts (data/split.py), which training never draws from:
no evaluation prompt occurs in training (`train_overlap` counts, to show it).
"""
from __future__ import annotations

import dataclasses

import gin
import numpy as np

from knittrans_jax.data import split
from knittrans_jax.rollout.groups import rollout_groups

HELD_OUT = split.HELD_OUT_GROUP_IDS


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """every_steps: 0 turns evaluation off (else every that many steps and after the
  last). at_start: also evaluate the initial policy, before the first step.
  prompts_per_source: held-out prompts per source."""
  every_steps: int = 0
  at_start: bool = True
  prompts_per_source: int = 16
  seed_offset: int = 1_000_003

  def __post_init__(self):
    if self.every_steps < 0 or self.prompts_per_source <= 0:
      raise ValueError(f"EvalConfig: every_steps {self.every_steps} >= 0 and prompts_per_source "
                       f"{self.prompts_per_source} > 0 are required")


class Evaluator:

  def __init__(self, config: EvalConfig, graphdef, sampler, suite, sources, seed: int):
    """`suite`: the run's task suite (suites/)."""
    self.config, self.graphdef, self.suite = config, graphdef, suite
    self.sources, self.train_seed = tuple(sources), seed
    self.seed = seed + config.seed_offset
    # Held-out group ids start at 2^31, far above any id training dispatches.
    self.requests = [(HELD_OUT + k * len(sources) + i, s) for i, s in enumerate(sources)
                     for k in range(config.prompts_per_source)]
    self.samplers = {"greedy": dataclasses.replace(sampler, greedy=True),
                     "sampled": dataclasses.replace(sampler, greedy=False)}

  def _prompt_key(self, seed: int, group_id: int, source: str) -> bytes:
    task = self.suite.task(seed, group_id, source)
    image = getattr(task, "image", None)
    return b"|".join([source.encode(), np.asarray(task.prompt).tobytes(),
                      b"" if image is None else np.asarray(image).tobytes()])

  def train_overlap(self, train_group_ids) -> int:
    """How many evaluation prompts occur among the prompts of training group ids
    `train_group_ids` (each id's prompt under every source: a superset of what was
    trained). 0 by construction; computed so that a run shows it."""
    evaluated = {self._prompt_key(self.seed, gid, s) for gid, s in self.requests}
    trained = {self._prompt_key(self.train_seed, gid, s) for gid in train_group_ids
               for s in self.sources}
    return len(evaluated & trained)

  def due(self, step: int, last: int) -> bool:
    every = self.config.every_steps
    return bool(every) and (step % every == 0 or step == last)

  def __call__(self, params, version: int) -> dict:
    out = {}
    for name, sampler in self.samplers.items():
      groups = rollout_groups(self.graphdef, params, version, self.seed, self.requests, 1,
                              sampler, self.suite)
      out[name] = float(np.mean([g.trajectories[0].reward for g in groups]))
    return out
