"""Group-normalised advantages (GRPO)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def group_advantages(rewards, group_size: int, normalize_std: bool = True, eps: float = 1e-6):
  """Advantages of rewards laid out group by group ([G * n] -> [G * n]).

  A = r - mean(group), divided by the group's std when `normalize_std` (Dr. GRPO
  turns it off). A group whose rewards all agree gets zero advantages.
  Works on numpy (host, at admission) and jax arrays (inside a jitted step).
  """
  xp = jnp if not isinstance(rewards, np.ndarray) else np
  r = xp.asarray(rewards, dtype=xp.float32)
  if r.ndim != 1 or r.shape[0] % group_size:
    raise ValueError(f"rewards of shape {r.shape} do not split into groups of {group_size}")
  g = r.reshape(-1, group_size)
  centred = g - g.mean(axis=1, keepdims=True)
  if normalize_std:
    centred = centred / (g.std(axis=1, keepdims=True) + eps)
  return centred.reshape(-1)


def group_advantages_by_id(groups, normalize_std: bool = True) -> dict:
  """{trajectory id: advantage} from each admitted group's rewards (GRPO), over the
  groups' metadata alone (the step planner's side, job/work.py)."""
  out = {}
  for grp in groups:
    rewards = np.array([m.reward for m in grp.metas], np.float32)
    adv = group_advantages(rewards, len(rewards), normalize_std)
    out.update({m.id: float(a) for m, a in zip(grp.metas, adv)})
  return out
