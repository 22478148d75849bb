"""The 'math' suite: a prompt data set through a real tokenizer and its chat
template (rollout/math_tasks.py), scored by the verifiable math reward; the
tokenizer's stop tokens end each response."""
from __future__ import annotations

import dataclasses

import numpy as np

from knittrans_jax.rollout import math_tasks
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.suites.base import TaskSuite


@dataclasses.dataclass(frozen=True)
class MathSuite(TaskSuite):
  """`config` and `tokenizer_dir` as the root resolved them (job/setup.py); the data
  set and tokenizer load once per process (math_tasks.suite_for's cache)."""
  config: math_tasks.MathTaskConfig
  tokenizer_dir: str
  seed: int = 0
  name = "math"

  @property
  def tasks(self) -> math_tasks.MathTasks:
    return math_tasks.suite_for(self.config, self.tokenizer_dir, self.seed)

  @property
  def sources(self) -> tuple[str, ...]:
    return self.tasks.sources

  @property
  def prompt_len(self) -> int:
    return self.config.prompt_len

  @property
  def vocab_size(self) -> int:
    return self.tasks.tokenizer.vocab_size

  def sampler(self, sampler: SamplerConfig) -> SamplerConfig:
    return dataclasses.replace(sampler, stop_tokens=self.tasks.tokenizer.stop_ids)

  def check(self, setup) -> None:
    self.tasks.check_lengths()  # an over-long prompt is an error now, not mid-run

  def task(self, seed: int, group_id: int, source: str):
    return self.tasks.task(group_id, source)  # the data set keeps its own split

  def score(self, task, response: np.ndarray) -> float:
    return self.tasks.score(task, response)

