"""One GRPO group: a task from its seed, n sampled responses, scored trajectories."""
from __future__ import annotations

import jax
import numpy as np

from knittrans_jax.rollout import tasks
from knittrans_jax.rollout.sampler import SamplerConfig, generate
from knittrans_jax.types import Trajectory

PROMPT_LEN = 5  # the longest task prompt; prompts are left-padded to it


def task_for(seed: int, group_id: int, source: str) -> tasks.Task:
  """The task of a group is a pure function of (seed, group id, source)."""
  return tasks.make_task(np.random.default_rng([seed, group_id]), source)


def rollout_groups(graphdef, params, version: int, seed: int, requests: list[tuple[int, str]],
                   n: int, sampler: SamplerConfig) -> list[list[Trajectory]]:
  """Generates n responses for each (group id, source) in one sampler call.

  The sampling key depends on the seed and the first group id only, so a run is
  reproducible for a given assignment of groups to calls.
  """
  task_list = [task_for(seed, gid, source) for gid, source in requests]
  prompts = [t.prompt for t in task_list for _ in range(n)]
  rng = jax.random.fold_in(jax.random.key(seed), requests[0][0])
  outs = generate(graphdef, params, prompts, rng, sampler, prompt_len=PROMPT_LEN)
  groups = []
  for k, ((gid, source), task) in enumerate(zip(requests, task_list)):
    groups.append([Trajectory(prompt_tokens=task.prompt, response_tokens=resp, logprobs=lp,
                              loss_mask=np.ones(resp.size, bool), reward=tasks.score(task, resp),
                              source=source, group_id=gid, index_in_group=i, versions=(version,))
                   for i, (resp, lp) in enumerate(outs[k * n:(k + 1) * n])])
  return groups
