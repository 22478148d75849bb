"""On-demand reads of one consumer's micro-batches: host data out, nothing called back.

    reads = OnDemandReads(store)
    seg = reads.segment(plan)          # one mini-batch's micro-batches
    payload = seg.micro_batch(k)       # read now, straight from the storage units

Each image of a segment is read once and reused by its later micro-batches (or not
at all with read_images=False: the encode-once path reads its image slots itself,
through `seg.read`). A store without dedup (StoreSchema.dedup_images=False, the
equal-bytes layout) keeps a copy per trajectory, and every micro-batch reads its
trajectories' copies: nothing is reused. With `read=QuarantiningReader(store).read`
a damaged unit is quarantined instead of failing: the micro-batch comes with its
intact rows only, and the skipped rows are in that reader's bad_rows.

The reads are synchronous and return host arrays. Who prepares them, puts them on
the devices and overlaps all of it with compute is the consumer's business (the
trainer's prefetch stream, job/prefetch.py), so data flows one way: storage ->
these reads -> the trainer.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

from knittrans_jax.storage import TrajectoryStore
from knittrans_jax.types import Payload, TrajMeta

ReadFn = Callable[[Sequence[TrajMeta], Any], Payload]  # (metas, image ids to skip) -> Payload


class DataReadError(RuntimeError):
  """A micro-batch could not be read; names the micro-batch, units and rows."""


def describe(k: int, metas: Sequence[TrajMeta]) -> str:
  """'micro-batch k (units [...], rows [...])': what a read error names."""
  units, rows = sorted({m.unit for m in metas}), [m.id for m in metas]
  return f"micro-batch {k} (units {units}, rows {rows[:4]}{'...' if len(rows) > 4 else ''})"


@dataclasses.dataclass
class ReadStats:
  """What one consumer read, over the whole run."""
  bytes_read: int = 0
  bytes_local: int = 0  # from units on this consumer's host (when hosts are known)
  rows_read: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  images_read: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class OnDemandReads:
  """One consumer's reads from the storage units. `read` replaces the store's read
  (a QuarantiningReader's, in the job); `unit_host`/`host` count the bytes read from
  units on this consumer's own host."""

  def __init__(self, store: TrajectoryStore, read: ReadFn | None = None,
               unit_host: Callable[[str], str] | None = None, host: str | None = None):
    self.read = read or (lambda metas, skip: store.read(metas, skip_images=skip).result())
    self.reuse_images = store.schema.dedup_images
    self.unit_host, self.host = unit_host, host
    self.stats = ReadStats()

  def segment(self, plan: Sequence[Sequence[TrajMeta]], read_images: bool = True) -> SegmentReads:
    return SegmentReads(self, [list(m) for m in plan], read_images)


class SegmentReads:
  """The reads of one mini-batch's micro-batches (one segment of the stream)."""

  def __init__(self, reads: OnDemandReads, plan: list[list[TrajMeta]], read_images: bool):
    self.reads, self.plan, self.read_images = reads, plan, read_images
    self.read = reads.read  # raw reads, for the encode-once image slots
    self._images: dict = {}
    # Without images (the encode-once path reads each image once, into its slot),
    # every image id of the segment counts as read already.
    self._skip = set() if read_images else {i for m in plan for x in m for i in x.image_ids}

  def micro_batch(self, k: int) -> Payload:
    """Micro-batch k of the plan, read now (host arrays)."""
    r, stats = self.reads, self.reads.stats
    skip = self._images.keys() | self._skip if r.reuse_images else self._skip
    payload = r.read(self.plan[k], skip)
    nbytes = payload.nbytes_read  # sequences, plus only the image copies read just now
    for iid, image in payload.images.items():
      self._images[iid] = image
      stats.images_read[iid] += 1
    if self.read_images:
      payload.images = {iid: self._images[iid] for m in payload.metas for iid in m.image_ids}
    stats.bytes_read += nbytes
    if r.unit_host is not None and r.host is not None:
      stats.bytes_local += sum(m.length * 9 for m in payload.metas  # int32+float32+uint8
                               if r.unit_host(m.unit) == r.host)
    stats.rows_read.update(m.id for m in payload.metas)
    return payload
