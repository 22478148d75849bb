"""Checks an append call in full and packs it into flat arrays, before any write.

Everything is validated up front so that a bad trajectory anywhere in a call means
nothing of the call is written.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Collection, Sequence

import numpy as np

from knittrans_jax.storage.errors import TrajectoryValidationError as Bad
from knittrans_jax.storage.schema import StoreSchema
from knittrans_jax.types import Trajectory

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
  prompt_len: np.ndarray  # int64 [k]
  response_len: np.ndarray
  source: np.ndarray
  group_id: np.ndarray
  index_in_group: np.ndarray
  version_first: np.ndarray
  version_last: np.ndarray
  loss_tokens: np.ndarray  # response tokens with loss mask 1, per row
  reward: np.ndarray  # float64 [k]
  image_ids: list[tuple[str, ...]]


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


def pack_append(trajectories: Sequence[Trajectory], schema: StoreSchema,
                known_images: Collection[str]) -> PackedAppend:
  """Validates every trajectory; raises `TrajectoryValidationError` on the first bad field.

  `known_images`: the ids a trajectory may name (the unit's and the call's images;
  the call's only when the store keeps a copy per trajectory).

  The value checks of int32 tokens and float32 log-probs (the usual dtypes) run once
  over the packed call rather than per trajectory; if anything is bad, the call is
  checked again trajectory by trajectory, so the error names the first bad field.
  """
  if not trajectories:
    raise ValueError("append needs at least one trajectory")
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
                          "version_first", "version_last", "loss_tokens", "reward")}
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
    imgs.append(ids)
  ints = {k: np.asarray(v, np.int64) for k, v in cols.items() if k != "reward"}
  return PackedAppend(tokens=np.concatenate(toks), logprobs=np.concatenate(lps),
                      loss_mask=np.concatenate(masks), reward=np.asarray(cols["reward"], np.float64),
                      image_ids=imgs, **ints)
