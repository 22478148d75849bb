"""Payload -> the static-shape arrays a train step takes (host numpy, right-padded):
the trainer's side. The advantages it places come from the planner
(rl/advantages.group_advantages_by_id, over metadata)."""
from __future__ import annotations

import numpy as np

from knittrans_jax.types import Payload


def build_batch(payload: Payload, advantages: dict, seq_len: int, rows: int) -> dict:
  """Right-pads each trajectory to `seq_len`; pads the batch with empty rows to `rows`.

  Empty rows have no valid tokens and no loss tokens, so they change nothing.
  """
  n = len(payload.metas)
  if n > rows:
    raise ValueError(f"{n} trajectories do not fit a micro-batch of {rows} rows")
  tokens = np.zeros((rows, seq_len), np.int32)
  attn = np.zeros((rows, seq_len), bool)
  loss_mask = np.zeros((rows, seq_len), np.float32)
  logp = np.zeros((rows, seq_len), np.float32)
  adv = np.zeros((rows,), np.float32)
  # Each row's generating versions (padding rows: -1, never a version), for the
  # engine-vs-trainer log-prob sums at version lag 0 (rl/losses.py).
  v_first = np.full((rows,), -1, np.int32)
  v_last = np.full((rows,), -1, np.int32)
  for i, (m, t, lp, mk) in enumerate(zip(payload.metas, payload.tokens, payload.logprobs,
                                          payload.loss_mask)):
    if t.size > seq_len:
      raise ValueError(f"trajectory {m.id} has {t.size} tokens > seq_len {seq_len}")
    tokens[i, :t.size] = t
    attn[i, :t.size] = True
    loss_mask[i, :t.size] = mk
    logp[i, :t.size] = lp
    adv[i] = advantages[m.id]
    v_first[i], v_last[i] = m.version_first, m.version_last
  return dict(tokens=tokens, attention_mask=attn, loss_mask=loss_mask, behaviour_logp=logp,
              advantages=adv, version_first=v_first, version_last=v_last)
