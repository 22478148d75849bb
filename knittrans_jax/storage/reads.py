"""Asynchronous, batched payload reads for a list of trajectories.

Consecutive rows of a unit are coalesced into one range read per array (a whole
unit read is one read per array); all reads go out in one `ts.Batch` so the
kvstore can overlap them. `.result()` waits, checks what came back, and slices.
"""
from __future__ import annotations

from typing import Callable, Collection, Sequence

import numpy as np
import tensorstore as ts

from knittrans_jax.storage.errors import CorruptUnitError
from knittrans_jax.storage.images import image_id
from knittrans_jax.storage.unit_reader import UnitReader
from knittrans_jax.types import Payload, TrajMeta

_SEQ_ARRAYS = ("tokens", "logprobs", "loss_mask")


def _runs(order: list[int], metas: Sequence[TrajMeta]) -> list[list[int]]:
  """Splits indices (sorted by unit, offset) into runs of contiguous token ranges."""
  runs: list[list[int]] = []
  prev_unit, prev_end = None, -1
  for i in order:
    m = metas[i]
    if m.unit == prev_unit and m.token_start == prev_end:
      runs[-1].append(i)
    else:
      runs.append([i])
    prev_unit, prev_end = m.unit, m.token_start + m.prompt_len + m.response_len
  return runs


class ReadFuture:
  """Reads in flight; `result()` returns a `Payload` in the order asked for."""

  def __init__(self, metas: Sequence[TrajMeta], reader_of: Callable[[str], UnitReader],
               skip_images: Collection[str] = ()):
    self._metas = list(metas)
    order = sorted(range(len(metas)), key=lambda i: (metas[i].unit, metas[i].token_start))
    self._runs = _runs(order, self._metas)
    self._futures = []  # (unit, run, {array: future})
    self._image_futures = {}  # id -> (unit, dtype, shape, future)
    with ts.Batch() as batch:
      for run in self._runs:
        first, last = self._metas[run[0]], self._metas[run[-1]]
        reader = reader_of(first.unit)
        futs = {name: reader.arrays[name][first.token_start:last.token_end].read(batch=batch)
                for name in _SEQ_ARRAYS}
        self._futures.append((first.unit, run, futs))
      for m in self._metas:
        for iid in m.image_ids:
          if iid in self._image_futures or iid in skip_images:
            continue  # each image read once, however many trajectories share it
          reader = reader_of(m.unit)
          try:
            start, end, dtype, shape = reader.image_location(iid)
          except KeyError as e:
            raise CorruptUnitError(m.unit, str(e)) from e
          fut = reader.arrays["images/data"][start:end].read(batch=batch)
          self._image_futures[iid] = (m.unit, dtype, shape, fut)

  def done(self) -> bool:
    return all(f.done() for _, _, fs in self._futures for f in fs.values()) and all(
        f[3].done() for f in self._image_futures.values())

  def result(self) -> Payload:
    n = len(self._metas)
    out = {name: [None] * n for name in _SEQ_ARRAYS}
    for unit, run, futs in self._futures:
      arrays = {}
      for name, fut in futs.items():
        try:
          arrays[name] = fut.result()
        except Exception as e:
          raise CorruptUnitError(unit, f"reading {name} failed: {e}") from e
      # Fill values mark chunks that are missing inside the committed range.
      if ((arrays["tokens"] < 0).any() or np.isnan(arrays["logprobs"]).any()
          or (arrays["loss_mask"] > 1).any()):
        raise CorruptUnitError(unit, "payload chunk missing inside the committed range "
                               f"(rows {self._metas[run[0]].row}..{self._metas[run[-1]].row})")
      arrays["loss_mask"] = arrays["loss_mask"].view(np.bool_)
      base = self._metas[run[0]].token_start
      bounds = [(self._metas[i].token_start - base, self._metas[i].token_end - base) for i in run]
      for name, arr in arrays.items():  # views into the run's buffer, no copies
        dst = out[name]
        for i, (lo, hi) in zip(run, bounds):
          dst[i] = arr[lo:hi]
    images = {}
    for iid, (unit, dtype, shape, fut) in self._image_futures.items():
      try:
        raw = fut.result()
      except Exception as e:
        raise CorruptUnitError(unit, f"reading image {iid} failed: {e}") from e
      image = raw.view(dtype).reshape(shape)
      if image_id(image) != iid:  # catches missing or damaged image chunks and hashes
        raise CorruptUnitError(unit, f"image {iid} does not match its content hash")
      images[iid] = image
    return Payload(metas=self._metas, tokens=out["tokens"], logprobs=out["logprobs"],
                   loss_mask=out["loss_mask"], images=images)
