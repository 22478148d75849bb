"""Checks an append call in full and packs it into flat arrays, before any write.

Everything is validated up front so that a bad trajectory anywhere in a call means
nothing of the call is written.

Two passes, one answer. `_pack_fast` takes calls of the usual types (int32 tokens,
float32 log-probs, bool or uint8 masks, plain ints and floats) with exact type and
shape checks made field by field over the whole call (a set of the types of every
trajectory's field, min and max of its ints: a few C-level passes, not a Python loop
of checks per trajectory) and the value checks (token range, finite log-probs and
rewards, mask values) once over the packed call; anything else,
or anything bad, goes to `_pack`, which checks field by field and raises the error
naming the first bad field and its value. So the fast pass never decides an error
message, only whether the call is fine as it is.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from typing import Collection, Sequence

import numpy as np

from knittrans_jax.storage import layout as L
from knittrans_jax.storage.errors import TrajectoryValidationError as Bad
from knittrans_jax.storage.schema import StoreSchema
from knittrans_jax.types import Trajectory, TurnSpan

_INT32_MAX = np.iinfo(np.int32).max
_INT64_MAX = np.iinfo(np.int64).max
_UNKNOWN_IMAGE = {  # by StoreSchema.dedup_images
    True: "image id is not in this unit's image table (pass the image to append(..., images=...))",
    False: "image id is not among this call's images; with StoreSchema.dedup_images=False each "
           "trajectory stores its own copy, so pass its images in the same append(..., images=...)",
}


@dataclasses.dataclass
class PackedAppend:
  tokens: np.ndarray  # int32 [T], sequences back to back
  logprobs: np.ndarray  # float32 [T]
  loss_mask: np.ndarray  # uint8 [T]
  # int64 [ROW_COLS, k]: the `rows` columns, by their layout index, so that the
  # writer fills in the three end offsets (TOK_END, REF_END, TURN_END: they continue
  # the unit's) and writes the transpose, with no column copied one by one. The
  # reward is among them as its float64 bits (REWARD).
  cols: np.ndarray
  image_ids: list[tuple[str, ...]]
  turns: np.ndarray  # int64 [turns, TURN_COLS], every row's turns back to back
  turn_count: np.ndarray  # int64 [k]

  # The columns by name (views of `cols`); loss_tokens: response tokens with loss
  # mask 1; gen_us / env_us: microseconds generating and in the environment.
  prompt_len = property(lambda self: self.cols[L.PROMPT_LEN])
  response_len = property(lambda self: self.cols[L.RESPONSE_LEN])
  source = property(lambda self: self.cols[L.SOURCE])
  group_id = property(lambda self: self.cols[L.GROUP_ID])
  index_in_group = property(lambda self: self.cols[L.INDEX_IN_GROUP])
  version_first = property(lambda self: self.cols[L.V_FIRST])
  version_last = property(lambda self: self.cols[L.V_LAST])
  loss_tokens = property(lambda self: self.cols[L.LOSS_TOKENS])
  gen_us = property(lambda self: self.cols[L.GEN_US])
  env_us = property(lambda self: self.cols[L.ENV_US])
  reward = property(lambda self: self.cols[L.REWARD].view(np.float64))  # float64 [k]


def _row_cols(k: int, reward, **named) -> np.ndarray:
  """PackedAppend.cols from columns by name (each k values); the writer's columns zero."""
  cols = np.zeros((L.ROW_COLS, k), np.int64)
  for name, values in named.items():
    cols[_COL_INDEX[name]] = values
  cols[L.REWARD] = np.asarray(reward, np.float64).view(np.int64)
  return cols


_COL_INDEX = {"prompt_len": L.PROMPT_LEN, "response_len": L.RESPONSE_LEN, "source": L.SOURCE,
              "group_id": L.GROUP_ID, "index_in_group": L.INDEX_IN_GROUP,
              "version_first": L.V_FIRST, "version_last": L.V_LAST,
              "loss_tokens": L.LOSS_TOKENS, "gen_us": L.GEN_US, "env_us": L.ENV_US}


def _token_array(value, field: str, i: int, gid, max_len: int, values: bool) -> np.ndarray:
  arr = np.asarray(value)
  if arr.dtype.kind not in "iu":
    raise Bad(field, i, arr.dtype, "must be an integer array", gid)
  if arr.ndim != 1:
    raise Bad(field, i, arr.shape, "must be 1-D", gid)
  if arr.size == 0:
    raise Bad(field, i, arr.shape, "must not be empty", gid)
  if arr.size > max_len:
    raise Bad(field, i, arr.size, f"length exceeds the configured maximum {max_len}", gid)
  if values or arr.dtype != np.int32:  # else the call's min is checked at once
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _INT32_MAX:
      raise Bad(field, i, (lo, hi), "token ids must lie in [0, 2**31)", gid)
  return arr.astype(np.int32, copy=False)


def _int_field(value, field: str, i: int, gid, minimum: int = 0) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise Bad(field, i, value, "must be an int", gid)
  if value < minimum or value > _INT64_MAX:
    raise Bad(field, i, value, f"must lie in [{minimum}, 2**63)", gid)
  return int(value)


def _seconds(value, field: str, i: int, gid) -> int:
  """Seconds as whole microseconds (what the store keeps)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise Bad(field, i, value, "must be a real number of seconds", gid)
  if not math.isfinite(float(value)) or value < 0:
    raise Bad(field, i, value, "must be finite and >= 0", gid)
  return int(round(float(value) * 1e6))


def _turns(value, i: int, gid, response_len: int, versions: list[int]) -> list[tuple]:
  """An episode's turns: in order, inside the response, not overlapping, each
  generated by versions the trajectory lists the range of."""
  if not isinstance(value, (list, tuple)):
    raise Bad("turns", i, type(value).__name__, "must be a list or tuple of TurnSpan", gid)
  out, prev_end = [], 0
  lo, hi = min(versions), max(versions)
  for k, span in enumerate(value):
    if not isinstance(span, TurnSpan):
      raise Bad("turns", i, span, f"turn {k} must be a knittrans_jax.types.TurnSpan", gid)
    start = _int_field(span.start, f"turns[{k}].start", i, gid)
    end = _int_field(span.end, f"turns[{k}].end", i, gid)
    v0 = _int_field(span.version_first, f"turns[{k}].version_first", i, gid)
    v1 = _int_field(span.version_last, f"turns[{k}].version_last", i, gid)
    if not prev_end <= start < end <= response_len:
      raise Bad("turns", i, span, f"turn {k} must be non-empty, after turn {k - 1}'s end "
                f"{prev_end} and inside the response ({response_len} tokens)", gid)
    if not lo <= v0 <= v1 <= hi:
      raise Bad("turns", i, span, f"turn {k}'s versions must be ordered and within the "
                f"trajectory's versions [{lo}, {hi}]", gid)
    out.append((start, end, v0, v1))
    prev_end = end
  return out


_INTS = (int, np.integer)
_REALS = (int, float, np.integer, np.floating)


def _is_int(value) -> bool:
  """An int in [0, 2**63), as `_int_field` takes it (bools are not)."""
  return type(value) is not bool and isinstance(value, _INTS) and 0 <= value <= _INT64_MAX


def _is_real(value) -> bool:
  """A real number as `_seconds` and the reward check take it (bools are not); the
  finite and range checks are the caller's."""
  return type(value) is not bool and isinstance(value, _REALS)


def _ints(values) -> bool:
  """Every value an int in [0, 2**63): plain ints by one set of types and their min
  and max; anything else value by value."""
  if set(map(type, values)) == _INT_TYPE:
    return min(values) >= 0 and max(values) <= _INT64_MAX
  return all(map(_is_int, values))


def _reals(values) -> bool:
  return set(map(type, values)) <= _PLAIN_REALS or all(map(_is_real, values))


_INT_TYPE, _PLAIN_REALS, _ND = {int}, {float, int}, {np.ndarray}
_SEQUENCES, _STR, _TUPLE = {tuple, list}, {str}, {tuple}
_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)
_I32S, _F32S, _BOOLS = {_I32}, {_F32}, {np.dtype(bool)}
_MASKS = _BOOLS | {np.dtype(np.uint8)}
_DTYPE, _NDIM = operator.attrgetter("dtype"), operator.attrgetter("ndim")
_SIZE, _SHAPE = operator.attrgetter("size"), operator.attrgetter("shape")
_MAX_US_SECONDS = 9.2e12  # seconds whose microseconds still fit an int64 (2**63 / 1e6)
_ZEROS: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # max_prompt_len -> prompt pads


_FIELDS = operator.attrgetter(
    "prompt_tokens", "response_tokens", "logprobs", "loss_mask", "group_id", "index_in_group",
    "reward", "versions", "source", "image_ids", "turns", "gen_seconds", "env_seconds")


def _pack_fast(trajectories: Sequence[Trajectory], schema: StoreSchema,
               known_images: Collection[str], out=None) -> PackedAppend | None:
  """The call packed, if every trajectory has the usual types and passes every check;
  None otherwise (`_pack` then finds the first bad field, or packs what this pass
  does not take). Each check runs over one field of every trajectory at once (maps
  and sets: C loops), so its cost per trajectory is a few attribute reads."""
  trajectories = list(trajectories)
  if set(map(type, trajectories)) != {Trajectory}:
    return None
  (ps, rs, lps, ms, gids, idxs, rewards, versions, sources, ids, spans, gens,
   envs) = zip(*map(_FIELDS, trajectories))
  seqs = ps + rs
  if not (set(map(type, seqs + lps + ms)) == _ND and set(map(_DTYPE, seqs)) == _I32S
          and set(map(_DTYPE, lps)) == _F32S and set(map(_DTYPE, ms)) <= _MASKS
          and set(map(_NDIM, seqs)) == {1}):
    return None
  n_p, n_r, shapes = list(map(_SIZE, ps)), list(map(_SIZE, rs)), list(map(_SHAPE, rs))
  if not (0 < min(n_p) and max(n_p) <= schema.max_prompt_len and 0 < min(n_r)
          and max(n_r) <= schema.max_response_len and list(map(_SHAPE, lps)) == shapes
          and list(map(_SHAPE, ms)) == shapes):
    return None
  if not (_ints(gids) and _ints(idxs) and _reals(rewards)
          and set(map(type, versions)) <= _SEQUENCES and all(versions)
          and _ints([v for vs in versions for v in vs])
          and set(map(type, sources)) == _STR and set(map(type, spans)) <= _SEQUENCES):
    return None
  source = list(map({s: i for i, s in enumerate(schema.sources)}.get, sources))
  if None in source:
    return None
  if set(map(type, ids)) != _TUPLE:
    ids = list(map(tuple, ids))
  if any(ids) and not all(image in known_images for row in ids for image in row):
    return None
  turns, turn_count = [], [0] * len(ps)
  if any(spans):
    for i, (row, gid, n, vs) in enumerate(zip(spans, gids, n_r, versions)):
      if row:
        try:
          row = _turns(row, i, gid, n, [int(v) for v in vs])
        except Bad:
          return None
        turns += row
        turn_count[i] = len(row)
  seconds = gens + envs
  if not _reals(seconds):
    return None
  us = [0] * len(seconds)
  if any(seconds):  # all zero (the usual call) needs no more; NaN is true, checked here
    if not all(0 <= x < _MAX_US_SECONDS for x in seconds):
      return None
    # round(float(x) * 1e6), as _seconds: the same float64 product, rounded half to even
    us = np.rint(np.array(seconds, np.float64) * 1e6).astype(np.int64)
  zeros = _ZEROS.get(schema.max_prompt_len)
  if zeros is None:
    zeros = _ZEROS[schema.max_prompt_len] = (np.zeros(schema.max_prompt_len, np.float32),
                                             np.zeros(schema.max_prompt_len, np.uint8))
  zf, zm = zeros
  planes = out(sum(n_p) + sum(n_r)) if out is not None else None
  tokens, logprobs, mask = planes or (None, None, None)
  tokens = np.concatenate([x for pair in zip(ps, rs) for x in pair], out=tokens)
  logprobs = np.concatenate([x for n, lp in zip(n_p, lps) for x in (zf[:n], lp)], out=logprobs)
  parts = [x for n, m in zip(n_p, ms) for x in (zm[:n], m)]
  mask = np.concatenate(parts, dtype=np.uint8) if mask is None else np.concatenate(parts, out=mask)
  reward = np.array(rewards, np.float64)
  # Bool masks hold only 0 and 1.
  if not (tokens.min() >= 0 and np.isfinite(logprobs).all() and np.isfinite(reward).all()
          and (set(map(_DTYPE, ms)) == _BOOLS or mask.max() <= 1)):
    return None
  cols = np.zeros((L.ROW_COLS, len(ps)), np.int64)  # row by row: faster than one np.array
  cols[L.PROMPT_LEN], cols[L.RESPONSE_LEN], cols[L.SOURCE] = n_p, n_r, source
  cols[L.GROUP_ID], cols[L.INDEX_IN_GROUP] = gids, idxs
  cols[L.V_FIRST], cols[L.V_LAST] = list(map(min, versions)), list(map(max, versions))
  cols[L.LOSS_TOKENS] = list(map(np.count_nonzero, ms))
  cols[L.REWARD] = reward.view(np.int64)
  if type(us) is not list:
    cols[L.GEN_US], cols[L.ENV_US] = us[:len(ps)], us[len(ps):]
  return PackedAppend(tokens=tokens, logprobs=logprobs, loss_mask=mask, cols=cols,
                      image_ids=ids if type(ids) is list else list(ids),
                      turns=np.asarray(turns, np.int64).reshape(-1, L.TURN_COLS),
                      turn_count=np.asarray(turn_count, np.int64))


def pack_append(trajectories: Sequence[Trajectory], schema: StoreSchema,
                known_images: Collection[str], out=None) -> PackedAppend:
  """Validates every trajectory; raises `TrajectoryValidationError` on the first bad field.

  `known_images`: the ids a trajectory may name (the unit's and the call's images;
  the call's only when the store keeps a copy per trajectory). `out(n)`: where to
  pack the call's n tokens (three planes: ids, log-probs, mask), or None for new
  arrays (whole_chunks.WholeChunkAppender.reserve_sequences); a call that fails a
  check may leave anything there.

  A call of the usual types is checked in one pass (`_pack_fast`: its value checks
  once over the packed call). Any other call, or one that fails a check there, is
  packed by `_pack`: its int32 token and float32 log-prob values are checked once
  over the packed call too, and if anything is bad, the call is checked again
  trajectory by trajectory, so the error names the first bad field.
  """
  if not trajectories:
    raise ValueError("append needs at least one trajectory")
  packed = _pack_fast(trajectories, schema, known_images, out)
  if packed is not None:
    return packed
  try:
    packed = _pack(trajectories, schema, known_images, values=False)
  except Bad:
    packed = None
  if packed is not None and packed.tokens.min() >= 0 and np.isfinite(packed.logprobs).all():
    return packed
  return _pack(trajectories, schema, known_images, values=True)


def _pack(trajectories: Sequence[Trajectory], schema: StoreSchema,
          known_images: Collection[str], values: bool) -> PackedAppend:
  """The call packed; `values=False` skips the checks of int32 token and float32
  log-prob values, for the caller to make over the packed arrays."""
  toks, lps, masks, imgs = [], [], [], []
  cols = {k: [] for k in ("prompt_len", "response_len", "source", "group_id", "index_in_group",
                          "version_first", "version_last", "loss_tokens", "reward",
                          "turn_count", "gen_us", "env_us")}
  turns: list[tuple] = []
  for i, t in enumerate(trajectories):
    if not isinstance(t, Trajectory):
      raise Bad("trajectory", i, type(t).__name__, "must be a knittrans_jax.types.Trajectory")
    gid = _int_field(t.group_id, "group_id", i, None)
    prompt = _token_array(t.prompt_tokens, "prompt_tokens", i, gid, schema.max_prompt_len, values)
    resp = _token_array(t.response_tokens, "response_tokens", i, gid, schema.max_response_len,
                        values)

    lp = np.asarray(t.logprobs)
    if lp.dtype.kind != "f":
      raise Bad("logprobs", i, lp.dtype, "must be a float array", gid)
    if lp.shape != resp.shape:
      raise Bad("logprobs", i, lp.shape, f"shape must equal response_tokens shape {resp.shape}", gid)
    if (values or lp.dtype != np.float32) and not np.isfinite(lp).all():
      raise Bad("logprobs", i, lp[~np.isfinite(lp)][:3], "must be finite", gid)

    mask = np.asarray(t.loss_mask)
    if mask.dtype.kind not in "biu":
      raise Bad("loss_mask", i, mask.dtype, "must be bool or integer 0/1", gid)
    if mask.shape != resp.shape:
      raise Bad("loss_mask", i, mask.shape, f"shape must equal response_tokens shape {resp.shape}", gid)
    if mask.dtype.kind != "b" and not np.isin(mask, (0, 1)).all():
      raise Bad("loss_mask", i, np.unique(mask)[:5], "values must be 0 or 1", gid)

    reward = t.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
      raise Bad("reward", i, reward, "must be a real number", gid)
    if not math.isfinite(float(reward)):
      raise Bad("reward", i, reward, "must be finite (NaN/inf rewards are refused)", gid)

    if t.source not in schema.sources:
      raise Bad("source", i, t.source, f"unknown source; the store knows {list(schema.sources)}", gid)

    versions = list(t.versions) if isinstance(t.versions, (list, tuple, np.ndarray)) else None
    if not versions:
      raise Bad("versions", i, t.versions, "must be a non-empty sequence of ints", gid)
    versions = [_int_field(v, "versions", i, gid) for v in versions]

    ids = tuple(t.image_ids)
    for image in ids:
      if image not in known_images:
        raise Bad("image_ids", i, image, _UNKNOWN_IMAGE[schema.dedup_images], gid)

    spans = _turns(t.turns, i, gid, resp.size, versions)
    gen_us = _seconds(t.gen_seconds, "gen_seconds", i, gid)
    env_us = _seconds(t.env_seconds, "env_seconds", i, gid)

    toks += [prompt, resp]
    lps += [np.zeros(prompt.size, np.float32), lp.astype(np.float32, copy=False)]
    masks += [np.zeros(prompt.size, np.uint8), mask.astype(np.uint8, copy=False)]
    cols["prompt_len"].append(prompt.size)
    cols["response_len"].append(resp.size)
    cols["source"].append(schema.source_index(t.source))
    cols["group_id"].append(gid)
    cols["index_in_group"].append(_int_field(t.index_in_group, "index_in_group", i, gid))
    cols["version_first"].append(min(versions))
    cols["version_last"].append(max(versions))
    cols["loss_tokens"].append(int(np.count_nonzero(mask)))
    cols["reward"].append(float(reward))
    cols["turn_count"].append(len(spans))
    cols["gen_us"].append(gen_us)
    cols["env_us"].append(env_us)
    turns += spans
    imgs.append(ids)
  named = {k: v for k, v in cols.items() if k != "turn_count"}
  return PackedAppend(tokens=np.concatenate(toks), logprobs=np.concatenate(lps),
                      loss_mask=np.concatenate(masks), cols=_row_cols(len(imgs), **named),
                      image_ids=imgs,
                      turns=np.asarray(turns, np.int64).reshape(-1, L.TURN_COLS),
                      turn_count=np.asarray(cols["turn_count"], np.int64))
