"""Payload -> the static-shape arrays a train step takes (host numpy): right-padded,
a row per trajectory, or packed, several trajectories a row. The trainer's side.
The advantages it places come from the planner (rl/advantages.group_advantages_by_id,
over metadata), the packed rows too (dataplane/packing.py)."""
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


def build_packed_batch(payload: Payload, advantages: dict, row_of: dict, seq_len: int,
                       rows: int) -> dict:
  """Packs each trajectory into its planned row (`row_of`: id -> row), back to back in
  the order given, each a segment: `segment_ids` numbers them from 1 in their row (0
  on padding), `positions` count from 0 in each, and what the padded batch holds per
  row (advantages, generating versions) is per token here, so a row holds several.
  The decoder attends within a segment only (models/decoder.py), so the loss and its
  gradient are the padded batch's."""
  shape = (rows, seq_len)
  out = dict(tokens=np.zeros(shape, np.int32), attention_mask=np.zeros(shape, bool),
             segment_ids=np.zeros(shape, np.int32), positions=np.zeros(shape, np.int32),
             loss_mask=np.zeros(shape, np.float32), behaviour_logp=np.zeros(shape, np.float32),
             advantages=np.zeros(shape, np.float32),
             version_first=np.full(shape, -1, np.int32), version_last=np.full(shape, -1, np.int32))
  fill = np.zeros(rows, np.int64)  # tokens placed in each row
  segments = np.zeros(rows, np.int32)
  for m, t, lp, mk in zip(payload.metas, payload.tokens, payload.logprobs, payload.loss_mask):
    r = row_of[m.id]
    a, b = int(fill[r]), int(fill[r]) + t.size
    if not 0 <= r < rows or b > seq_len:
      raise ValueError(f"trajectory {m.id} ({t.size} tokens) does not fit packed row {r} of "
                       f"{rows} x {seq_len} tokens ({a} already placed there)")
    segments[r] += 1
    out["tokens"][r, a:b] = t
    out["attention_mask"][r, a:b] = True
    out["segment_ids"][r, a:b] = segments[r]
    out["positions"][r, a:b] = np.arange(t.size)
    out["loss_mask"][r, a:b] = mk
    out["behaviour_logp"][r, a:b] = lp
    out["advantages"][r, a:b] = advantages[m.id]
    out["version_first"][r, a:b], out["version_last"][r, a:b] = m.version_first, m.version_last
    fill[r] = b
  return out
