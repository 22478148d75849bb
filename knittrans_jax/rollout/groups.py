"""One GRPO group: a task from its seed, n sampled responses, scored trajectories.

Two task suites: 'text' (rollout/tasks.py) and 'vision' (rollout/vision_tasks.py,
one generated image per prompt, shared by the group's n responses: the sampler
encodes it once and the group stores it once).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from knittrans_jax.rollout import tasks, vision_tasks
from knittrans_jax.rollout.sampler import SamplerConfig, generate
from knittrans_jax.storage import image_id
from knittrans_jax.types import Trajectory

PROMPT_LEN = 5  # the longest text prompt; prompts are left-padded to it
SUITES = ("text", "vision")


def suite_sources(suite: str) -> tuple[str, ...]:
  return {"text": tasks.SOURCES, "vision": vision_tasks.SOURCES}[_check(suite)]


def suite_prompt_len(suite: str) -> int:
  return {"text": PROMPT_LEN, "vision": vision_tasks.PROMPT_LEN}[_check(suite)]


def _check(suite: str) -> str:
  if suite not in SUITES:
    raise ValueError(f"task suite {suite!r} is unknown; use one of {SUITES}")
  return suite


def task_for(seed: int, group_id: int, source: str, suite: str = "text", image_size: int = 32):
  """The task of a group is a pure function of (seed, group id, source)."""
  rng = np.random.default_rng([seed, group_id])
  if _check(suite) == "vision":
    return vision_tasks.make_task(rng, source, image_size)
  return tasks.make_task(rng, source)


@dataclasses.dataclass
class RolledGroup:
  trajectories: list[Trajectory]
  images: list[np.ndarray]  # stored once for the whole group (empty for text)


def rollout_groups(graphdef, params, version: int, seed: int, requests: list[tuple[int, str]],
                   n: int, sampler: SamplerConfig, suite: str = "text",
                   image_size: int = 32) -> list[RolledGroup]:
  """Generates n responses for each (group id, source) in one sampler call.

  The sampling key depends on the seed and the first group id only, so a run is
  reproducible for a given assignment of groups to calls.
  """
  task_list = [task_for(seed, gid, source, suite, image_size) for gid, source in requests]
  prompts = [t.prompt for t in task_list for _ in range(n)]
  rng = jax.random.fold_in(jax.random.key(seed), requests[0][0])
  score = vision_tasks.score if suite == "vision" else tasks.score
  extra = {}
  if suite == "vision":
    extra = dict(images=np.stack([t.image for t in task_list]),
                 image_index=np.repeat(np.arange(len(task_list)), n))
  outs = generate(graphdef, params, prompts, rng, sampler, prompt_len=suite_prompt_len(suite),
                  **extra)
  groups = []
  for k, ((gid, source), task) in enumerate(zip(requests, task_list)):
    images = [task.image] if suite == "vision" else []
    ids = tuple(image_id(im) for im in images)
    groups.append(RolledGroup([
        Trajectory(prompt_tokens=task.prompt, response_tokens=resp, logprobs=lp,
                   loss_mask=np.ones(resp.size, bool), reward=score(task, resp), source=source,
                   group_id=gid, index_in_group=i, versions=(version,), image_ids=ids)
        for i, (resp, lp) in enumerate(outs[k * n:(k + 1) * n])], images))
  return groups
