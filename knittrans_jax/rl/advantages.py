"""Advantage estimators over a mini-batch's groups (LossConfig.advantage).

Each is a pure function of the rewards laid out group by group ([G * n] -> [G * n]),
on numpy (the planner, at admission) or jax arrays:

  grpo          A_i = (r_i - mean_g r) / (std_g r + eps)              (Shao et al. 2024,
                DeepSeekMath, eq. 3: the group-normalised outcome advantage)
  dr_grpo       A_i = r_i - mean_g r                                  (Liu et al. 2025,
                "Understanding R1-Zero-Like Training", eq. 3: no std division)
  rloo          A_i = r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean_g r)
                (Ahmadian et al. 2024, "Back to Basics", eq. 7: leave-one-out baseline)
  reinforce_pp  A_i = (r_i - mean_g r) normalised over the whole mini-batch:
                (x - mean_B x) / (std_B x + eps)                      (Hu et al. 2025,
                "REINFORCE++", the baseline variant: group mean, then batch norm)

A group whose rewards all agree gets zero advantages under every estimator (only
reinforce_pp's batch normalisation can move it, by the batch mean; it does not:
the centred values have batch mean 0 already when every group is centred).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
EPS = 1e-6


def _groups(rewards, group_size: int):
  xp = jnp if not isinstance(rewards, np.ndarray) else np
  r = xp.asarray(rewards, dtype=xp.float32)
  if r.ndim != 1 or r.shape[0] % group_size:
    raise ValueError(f"rewards of shape {r.shape} do not split into groups of {group_size}")
  return xp, r.reshape(-1, group_size)


def advantages(rewards, group_size: int, estimator: str = "grpo", eps: float = EPS):
  """The advantages of `rewards` ([G * n], group by group) under `estimator`."""
  if estimator not in ESTIMATORS:
    raise ValueError(f"LossConfig.advantage = {estimator!r}: use one of {ESTIMATORS}")
  xp, g = _groups(rewards, group_size)
  centred = g - g.mean(axis=1, keepdims=True)
  if estimator == "grpo":
    out = centred / (g.std(axis=1, keepdims=True) + eps)
  elif estimator == "rloo":
    if group_size < 2:
      raise ValueError("LossConfig.advantage = 'rloo' needs groups of n >= 2 (a leave-one-out "
                       f"baseline), got n = {group_size}")
    out = centred * (group_size / (group_size - 1))
  elif estimator == "reinforce_pp":
    out = (centred - centred.mean()) / (centred.std() + eps)
  else:  # dr_grpo
    out = centred
  return out.reshape(-1)


def group_advantages(rewards, group_size: int, normalize_std: bool = True, eps: float = EPS):
  """GRPO's advantages (`normalize_std`) or Dr. GRPO's (without the std division)."""
  return advantages(rewards, group_size, "grpo" if normalize_std else "dr_grpo", eps)


def overlong_penalty(length, max_len: int, buffer: int):
  """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to a reward: 0 up
  to max_len - buffer tokens, then falling linearly to -1 at max_len, -1 beyond."""
  length = np.asarray(length, np.float32)
  start = max_len - buffer
  return np.where(length <= start, 0.0,
                  np.where(length <= max_len, (start - length) / buffer, -1.0)).astype(np.float32)


def advantages_by_id(groups, estimator: str = "grpo",
                     overlong: tuple[int, int] | None = None) -> dict:
  """{trajectory id: advantage} over the mini-batch's groups' metadata alone (the step
  planner's side, job/work.py): each group estimated on its own, and for
  reinforce_pp the group-centred values then normalised over the whole mini-batch.
  `overlong` (max_len, buffer): each reward shaped by `overlong_penalty` of its
  response length first (LossConfig.overlong_buffer)."""
  per_group = "dr_grpo" if estimator == "reinforce_pp" else estimator
  ids, adv = [], []
  for grp in groups:
    rewards = np.array([m.reward for m in grp.metas], np.float32)
    if overlong is not None:
      rewards = rewards + overlong_penalty([m.response_len for m in grp.metas], *overlong)
    ids += [m.id for m in grp.metas]
    adv.append(advantages(rewards, len(rewards), per_group))
  if not ids:
    return {}
  a = np.concatenate(adv)
  if estimator == "reinforce_pp":
    a = (a - a.mean()) / (a.std() + EPS)
  return {i: float(x) for i, x in zip(ids, a)}
