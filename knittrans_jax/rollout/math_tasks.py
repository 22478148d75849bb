"""The 'math' task suite: prompts from a JSONL data set through a checkpoint's chat
template, responses decoded and scored by the verifiable math reward.

A group's prompt is a pure function of (seed, group id, source) (data/prompts.py), so
workers on any host, a resumed run and a replay agree on it. Each process builds the
suite once from its picklable config (`suite_for`), loading the tokenizer and the
data set from paths every host can read.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import gin
import numpy as np

from knittrans_jax.data.prompts import PromptSet
from knittrans_jax.data.tokenizer import Tokenizer
from knittrans_jax.rollout.math_reward import math_reward
from knittrans_jax.rollout.tasks import Task

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                       "arith_word_problems.jsonl")
SYSTEM = ("Solve the problem. Think step by step, then give the final answer as a "
          "number in \\boxed{}.")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MathTaskConfig:
  """prompts: a JSONL prompt file (data/prompts.py); default the shipped arithmetic set.
  tokenizer: a directory with tokenizer.json; None: the job's checkpoint directory.
  prompt_len: prompts are left-padded to this many tokens; a longer one is an error.
  system: the system message ('' for none).
  date_string: passed to the chat template (Llama 3 templates print it); None lets the
    template fall back to today's date (`strftime_now`), as transformers does, which
    changes the prompts from day to day."""
  prompts: str = SHIPPED
  tokenizer: str | None = None
  prompt_len: int = 128
  system: str = SYSTEM
  date_string: str | None = None

  def __post_init__(self):
    if self.prompt_len <= 0:
      raise ValueError(f"MathTaskConfig.prompt_len = {self.prompt_len} must be positive")


class MathTasks:
  """sources, prompt_len, task(seed, group id, source) and score(task, response)."""

  def __init__(self, config: MathTaskConfig, tokenizer_dir: str, seed: int = 0):
    self.config = config
    self.prompt_len = config.prompt_len
    self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
    self.prompts = PromptSet.from_file(config.prompts, seed)
    self.sources = self.prompts.sources
    self._ids: dict[str, np.ndarray] = {}

  def _tokens(self, prompt) -> np.ndarray:
    if prompt.id not in self._ids:
      messages = ([{"role": "system", "content": self.config.system}] if self.config.system
                  else []) + [{"role": "user", "content": prompt.prompt}]
      extra = {} if self.config.date_string is None else {"date_string": self.config.date_string}
      ids = np.asarray(self.tokenizer.chat(messages, **extra), np.int32)
      if ids.size > self.prompt_len:
        raise ValueError(f"{self.config.prompts}: prompt {prompt.id!r} is {ids.size} tokens "
                         f"with the chat template; MathTaskConfig.prompt_len = {self.prompt_len}")
      self._ids[prompt.id] = ids
    return self._ids[prompt.id]

  def task(self, group_id: int, source: str) -> Task:
    p = self.prompts.prompt_for(group_id, source)
    return Task(source, self._tokens(p), {"answer": p.answer, "id": p.id})

  def score(self, task: Task, response: np.ndarray) -> float:
    response = np.asarray(response)
    stops = np.flatnonzero(np.isin(response, self.tokenizer.stop_ids))
    body = response[:stops[0]] if stops.size else response
    return math_reward(self.tokenizer.decode(body), task.answer["answer"])

  def check_lengths(self) -> int:
    """Tokenises every prompt (an over-long one is an error now, not mid-run); returns
    the longest."""
    return max(self._tokens(p).size for ps in self.prompts.by_source.values() for p in ps)


@functools.lru_cache(maxsize=4)
def suite_for(config: MathTaskConfig, tokenizer_dir: str, seed: int) -> MathTasks:
  return MathTasks(config, tokenizer_dir, seed)
