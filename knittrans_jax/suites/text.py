"""The 'text' suite: the tiny decoder's synthetic tasks (rollout/tasks.py), one
response each; the 'lookup' task's tool is inserted by the engine mid-response."""
from __future__ import annotations

import dataclasses

import numpy as np

from knittrans_jax.rollout import tasks
from knittrans_jax.rollout.engine import ToolInsert
from knittrans_jax.suites.base import TaskSuite

PROMPT_LEN = 5  # the longest text prompt; prompts are left-padded to it


@dataclasses.dataclass(frozen=True)
class TextSuite(TaskSuite):
  name = "text"
  sources = tasks.SOURCES
  prompt_len = PROMPT_LEN
  vocab_size = tasks.VOCAB_SIZE

  def draw(self, rng: np.random.Generator, source: str):
    return tasks.make_task(rng, source)

  def score(self, task, response: np.ndarray) -> float:
    return tasks.score(task, response)

  def tool(self, task) -> ToolInsert | None:
    if task.tool_output is None:
      return None
    return ToolInsert(tasks.CALL, np.asarray(task.tool_output, np.int32))
