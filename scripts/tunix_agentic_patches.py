"""Patches 3, 6 and 7 of scripts/tunix_agentic.py (its module doc): the sampler keeps
EOS, step rewards summed in turn order, the population-std group advantage (registered
with Tunix on import). Imported by path from scripts/ (Tunix's venv)."""
from __future__ import annotations

import functools

import numpy as np
from tunix.generate import utils as gen_utils
from tunix.rl import function_registry


class EosInclusiveUtils:
  """Patch 3: generate/utils with np_find_first_eos_idx past the EOS (only sampler.py
  :910/945 call it)."""

  def __getattr__(self, name):
    return getattr(gen_utils, name)

  @staticmethod
  def np_find_first_eos_idx(ids, eos_id):
    i = gen_utils.np_find_first_eos_idx(ids, eos_id)
    return i + 1 if i < len(ids) else i


def in_order_reward(self):
  """Patch 6: TrajectoryCollectEngine.compute_trajectory_reward, summed in turn order."""
  traj = self.agent.trajectory
  if traj:
    traj.reward = functools.reduce(lambda a, st: a + float(st.reward), traj.steps, 0.0)
  return traj or None


@function_registry.register_advantage_estimator("grpo_pop_std")
def grpo_pop_std(rewards, num_generations):  # patch 7
  r = np.asarray(rewards, np.float32).reshape(-1, num_generations)
  return ((r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + 1e-6)).reshape(-1)
