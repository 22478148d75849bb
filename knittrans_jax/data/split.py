"""The held-out split: which prompts evaluation may use and training never sees.

A prompt is held out by its content (its source, prompt tokens and image bytes),
not by where it was drawn, so the split is disjoint by construction: the same
prompt drawn for a training group and an evaluation group lands on the same side.
Group ids from HELD_OUT_GROUP_IDS up are evaluation groups; a task drawn for a group
on the wrong side of the split is drawn again (rollout/groups.task_for,
data/prompts.PromptSet.prompt_for). One prompt in FRACTION is held out.
"""
from __future__ import annotations

import hashlib

import numpy as np

HELD_OUT_GROUP_IDS = 1 << 31  # group ids are folded into uint32 sampling keys
FRACTION = 4
_SALT = b"knittrans-held-out-v1"


def for_evaluation(group_id: int) -> bool:
  """Whether a group id is an evaluation group's (so it draws held-out prompts)."""
  return group_id >= HELD_OUT_GROUP_IDS


def held_out(source: str, *parts) -> bool:
  """Whether the prompt of `source` made of `parts` (arrays, bytes or str) is held out."""
  h = hashlib.blake2b(_SALT + source.encode(), digest_size=8)
  for p in parts:
    if isinstance(p, str):
      p = p.encode()
    elif isinstance(p, np.ndarray):
      p = np.ascontiguousarray(p).tobytes()
    h.update(p)
  return int.from_bytes(h.digest(), "little") % FRACTION == 0
