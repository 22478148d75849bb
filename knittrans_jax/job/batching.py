"""Payload -> the static-shape arrays a train step takes (host numpy): right-padded,
a row per trajectory, or packed, several trajectories a row. The trainer's side.
The advantages it places come from the planner (rl/advantages.advantages_by_id,
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


def segment_spans(payload: Payload, row_of: dict, seq_len: int, rows: int,
                  prefix_tokens: int = 0) -> list[tuple[int, int, int]]:
  """(row, start, end) of each trajectory's segment, in payload order: back to back
  in its planned row (`row_of`: id -> row), `prefix_tokens` positions before its
  tokens. A segment past the row is an error naming the trajectory."""
  fill = np.zeros(rows, np.int64)
  spans = []
  for m, t in zip(payload.metas, payload.tokens):
    r = row_of[m.id]
    a = int(fill[r]) if 0 <= r < rows else 0
    b = a + prefix_tokens + t.size
    if not 0 <= r < rows or b > seq_len:
      extra = f" + {prefix_tokens} prefix" if prefix_tokens else ""
      raise ValueError(f"trajectory {m.id} ({t.size} tokens{extra}) does not fit packed row "
                       f"{r} of {rows} x {seq_len} tokens ({a} already placed there)")
    spans.append((r, a, b))
    fill[r] = b
  return spans


def build_packed_batch(payload: Payload, advantages: dict, row_of: dict, seq_len: int,
                       rows: int, prefix_tokens: int = 0, slot_of: dict | None = None,
                       spans: list[tuple[int, int, int]] | None = None) -> dict:
  """Packs each trajectory into its planned row (`row_of`: id -> row), back to back in
  the order given, each a segment: `segment_ids` numbers them from 1 in their row (0
  on padding), `positions` count from 0 in each, and what the padded batch holds per
  row (advantages, generating versions) is per token here, so a row holds several.
  The decoder attends within a segment only (models/decoder.py), so the loss and its
  gradient are the padded batch's.

  The toy VLM (`prefix_tokens` P > 0): each segment starts with P positions for its
  image's embeddings, `embed_index` [rows, seq_len] naming the row of the mini-batch's
  E [slots * P, width] each takes (slot_of[id] * P + p; -1 on every other position),
  as the padded VLM places the image before the text (models/vlm.py). `spans`: the
  segment_spans of these arguments, where the caller has them already."""
  shape = (rows, seq_len)
  P = prefix_tokens
  if P and slot_of is None:
    raise ValueError("build_packed_batch: prefix_tokens without slot_of (each trajectory's "
                     "image slot)")
  out = dict(tokens=np.zeros(shape, np.int32), attention_mask=np.zeros(shape, bool),
             segment_ids=np.zeros(shape, np.int32), positions=np.zeros(shape, np.int32),
             loss_mask=np.zeros(shape, np.float32), behaviour_logp=np.zeros(shape, np.float32),
             advantages=np.zeros(shape, np.float32),
             version_first=np.full(shape, -1, np.int32), version_last=np.full(shape, -1, np.int32))
  if P:
    out["embed_index"] = np.full(shape, -1, np.int32)
  segments = np.zeros(rows, np.int32)
  if spans is None:
    spans = segment_spans(payload, row_of, seq_len, rows, P)
  for (r, a, b), m, t, lp, mk in zip(spans, payload.metas, payload.tokens, payload.logprobs,
                                     payload.loss_mask):
    segments[r] += 1
    out["attention_mask"][r, a:b] = True
    out["segment_ids"][r, a:b] = segments[r]
    out["positions"][r, a:b] = np.arange(b - a)
    out["advantages"][r, a:b] = advantages[m.id]
    out["version_first"][r, a:b], out["version_last"][r, a:b] = m.version_first, m.version_last
    if P:
      out["embed_index"][r, a:a + P] = slot_of[m.id] * P + np.arange(P)
    a += P  # the text after the image
    out["tokens"][r, a:b] = t
    out["loss_mask"][r, a:b] = mk
    out["behaviour_logp"][r, a:b] = lp
  return out
