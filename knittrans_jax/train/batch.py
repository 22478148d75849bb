"""Train batches: the arrays a step takes, their checks and their shardings.

A text batch is a dict of
  tokens          int32   [B, T]  prompt + response, right-padded
  attention_mask  bool    [B, T]  real tokens
  loss_mask       float32 [B, T]  1 on response tokens that train
  behaviour_logp  float32 [B, T]  log-prob of each token under the rollout policy
  advantages      float32 [B]
A packed batch (several trajectories a row, job/batching.build_packed_batch) adds
  segment_ids     int32   [B, T]  1, 2, ... per trajectory in its row, 0 on padding
  positions       int32   [B, T]  each token's position within its trajectory
and has advantages (and version_first / version_last) per token, [B, T].
Optionally version_first / version_last int32 [B] (the versions that generated
each row, -1 for padding: the engine-vs-trainer sums at lag 0, rl/losses.py);
and a VLM batch adds images float32 [B, H, W, C] (the naive step: one image per
row) or image_index int32 [B] (the encode-once step: each row's slot among the
mini-batch's unique images, multimodal/). A Qwen-VL encode-once batch adds instead
positions int32 [B, 3, T] (M-RoPE, rows first so they shard like the tokens) and
embed_index int32 [B, T] (the row of the packed image embeddings each image-pad
token takes; multimodal/qwen_images.py).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from knittrans_jax.mesh import batch_size_multiple, logical_sharding

SPEC = {  # name: (dtype kinds, ranks allowed)
    "tokens": ("iu", (2,)), "attention_mask": ("bui", (2,)), "loss_mask": ("fbui", (2,)),
    "behaviour_logp": ("f", (2,)), "advantages": ("f", (1, 2)),
}
OPTIONAL = {"images": ("f", (4,)), "ref_logp": ("f", (2,)), "image_index": ("iu", (1,)),
            "positions": ("iu", (2, 3)), "embed_index": ("iu", (2,)),
            "version_first": ("i", (1, 2)), "version_last": ("i", (1, 2)),
            "segment_ids": ("iu", (2,))}
# Per row in a padded batch, per token in a packed one (segment_ids: several a row).
PER_ROW = ("advantages", "version_first", "version_last")


class BadBatchError(ValueError):
  """A batch that a step cannot take; names the field and the value."""


def check_batch(batch: dict, vocab_size: int, rows_multiple: int = 1) -> None:
  missing = set(SPEC) - set(batch)
  if missing:
    raise BadBatchError(f"batch is missing {sorted(missing)}")
  B, T = np.shape(batch["tokens"])[:2] if np.ndim(batch["tokens"]) == 2 else (None, None)
  packed = "segment_ids" in batch
  for name, (kinds, ranks) in {**SPEC, **{k: v for k, v in OPTIONAL.items() if k in batch}}.items():
    arr = batch[name]
    dtype = np.asarray(arr).dtype if not hasattr(arr, "dtype") else np.dtype(arr.dtype)
    if dtype.kind not in kinds:
      raise BadBatchError(f"batch['{name}'] has dtype {dtype}; expected kind {kinds!r}")
    shape = np.shape(arr)
    if name in PER_ROW:
      ranks = (2,) if packed else (1,)
    if len(shape) not in ranks:
      raise BadBatchError(f"batch['{name}'] has shape {shape}; expected rank "
                          f"{' or '.join(map(str, ranks))}" + (
                              " (per token in a packed batch, per row in a padded one)"
                              if name in PER_ROW else ""))
    rank = len(shape)
    if shape[0] != B or (rank == 2 and shape[1] != T):
      raise BadBatchError(f"batch['{name}'] has shape {shape}; tokens are [{B}, {T}]")
  if B % rows_multiple:
    raise BadBatchError(f"batch of {B} rows does not split over {rows_multiple} batch shards")
  tokens = np.asarray(batch["tokens"])
  lo, hi = int(tokens.min()), int(tokens.max())
  if lo < 0 or hi >= vocab_size:
    raise BadBatchError(f"batch['tokens'] holds ids in [{lo}, {hi}], outside the vocabulary "
                        f"[0, {vocab_size})")
  for name in ("behaviour_logp", "advantages", "images"):
    if name in batch and not np.isfinite(np.asarray(batch[name])).all():
      raise BadBatchError(f"batch['{name}'] holds NaN or inf")


def batch_shardings(mesh: Mesh, rules, batch: dict, stacked: bool = False) -> dict:
  """Rows split over the batch axes; a stacked [K, ...] batch keeps K unsplit."""
  lead = (None,) if stacked else ()
  return {k: logical_sharding(mesh, rules, *lead, "batch", *([None] * (np.ndim(v) - 1 - len(lead))))
          for k, v in batch.items()}


def put_batch(batch: dict, shardings: dict) -> dict:
  """Global arrays from this process's rows. With one process this is a device_put;
  under jax.distributed each process passes only its own consumer's rows."""
  return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v))
          for k, v in batch.items()}


def rows_multiple(mesh: Mesh, rules) -> int:
  return batch_size_multiple(mesh, rules)
