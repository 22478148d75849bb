"""On-demand, prefetching reads of one consumer's micro-batches, as one stream.

A background thread walks the micro-batches it is fed, in order: it reads each
straight from the storage units, prepares it (pads to the step's static shapes),
puts it on the devices with the step's sharding, and queues it, staying up to
`depth` items ahead of the step. The step's side only waits when the data is not
ready yet; that wait is the exposed transfer time.

One reader lives for the whole run: `feed(plan, prepare)` appends a mini-batch's
micro-batches (a *segment*) to the stream, so the next mini-batch is read while the
current one trains and no first micro-batch waits on a new reader's start.
Constructed with a `plan`, the reader is that one segment and iteration stops after
it. A segment may start with a `first` job, called in the thread with the reader's
read function (the encode-once step reads its image slots that way).

Each image of a segment is read once and reused by its later micro-batches (or not
at all with read_images=False: the encode-once path reads its image slots in the
`first` job). A store without dedup (StoreSchema.dedup_images=False, the
equal-bytes layout) keeps a copy per trajectory, and every micro-batch reads its
trajectories' copies: nothing is reused. A read error is raised in the step that needs that micro-batch,
naming its unit and rows, and the thread stops. With
`read=QuarantiningReader(store).read` a damaged unit is quarantined instead: the
micro-batch comes with its intact rows only (prepare pads the rest), and the
skipped rows are in that reader's bad_rows.
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from knittrans_jax.storage import TrajectoryStore
from knittrans_jax.types import Payload, TrajMeta


class DataReadError(RuntimeError):
  """A micro-batch could not be read; names the micro-batch, units and rows."""


@dataclasses.dataclass
class ReaderStats:
  exposed_wait_s: float = 0.0  # the step waited for data that was not ready
  raw_transfer_s: float = 0.0  # reads + preparation + host-to-device, summed
  bytes_read: int = 0
  bytes_local: int = 0  # from units on this consumer's host (when hosts are known)
  micro_batches: int = 0
  waits: list = dataclasses.field(default_factory=list)  # exposed wait per item taken
  rows_read: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  images_read: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class _Segment:
  plan: list[list[TrajMeta]]
  prepare: Callable[[Payload], Any]
  read_images: bool
  first: Callable | None

  @property
  def items(self) -> int:
    return len(self.plan) + (self.first is not None)


class PrefetchingReader:
  """Iterates prepared micro-batches, in the order they were fed (see module doc)."""

  def __init__(self, store: TrajectoryStore, plan: Sequence[Sequence[TrajMeta]] | None = None,
               prepare: Callable[[Payload], Any] | None = None, depth: int = 2,
               put: Callable[[Any], Any] | None = None,
               unit_host: Mapping[str, str] | None = None, host: str | None = None,
               read_images: bool = True,
               read: Callable[[Sequence[TrajMeta], Any], Payload] | None = None):
    if depth < 1:
      raise ValueError(f"prefetch depth {depth} must be >= 1")
    self.store, self.put, self.read_images = store, put, read_images
    self.read = read or (lambda metas, skip: store.read(metas, skip_images=skip).result())
    self._reuse_images = store.schema.dedup_images
    self.unit_host, self.host = unit_host, host
    self.stats = ReaderStats()
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._segments: collections.deque[_Segment] = collections.deque()
    self._cv = threading.Condition()
    self._stop = threading.Event()
    self._ended = False
    self._fed = self._taken = 0
    self._failed: Exception | None = None
    self._thread = threading.Thread(target=self._run, name="prefetching-reader", daemon=True)
    self._thread.start()
    if plan is not None:
      self.feed(plan, prepare)
      self.end()

  # -- the caller's side ----------------------------------------------------------
  def feed(self, plan: Sequence[Sequence[TrajMeta]], prepare: Callable[[Payload], Any],
           read_images: bool | None = None, first: Callable | None = None) -> None:
    """Appends a segment: `plan`'s micro-batches, after `first(read)` if given."""
    if self._ended:
      raise RuntimeError("feed() after end(): this reader's stream is closed")
    seg = _Segment([list(m) for m in plan], prepare,
                   self.read_images if read_images is None else read_images, first)
    with self._cv:
      self._segments.append(seg)
      self._fed += seg.items
      self._cv.notify()

  def end(self) -> None:
    """No more segments: iteration stops after the ones fed."""
    with self._cv:
      self._ended = True
      self._cv.notify()

  def ready(self) -> bool:
    """Whether the next item can be taken without waiting."""
    return not self._queue.empty()

  def take(self):
    """The next item of the stream (blocks until it is read)."""
    if self._failed is not None:
      raise DataReadError(f"the reader stopped after an earlier error: {self._failed}")
    if self._taken >= self._fed:
      raise RuntimeError(f"take(): all {self._fed} items fed were taken; feed() first")
    t0 = time.perf_counter()
    item = self._queue.get()
    waited = time.perf_counter() - t0
    self.stats.exposed_wait_s += waited
    self.stats.waits.append(waited)
    if isinstance(item, Exception):
      self._failed = item
      self.close()
      raise item
    self._taken += 1
    self.stats.micro_batches += 1
    return item

  def __iter__(self):
    return self

  def __next__(self):
    if self._ended and self._taken >= self._fed:
      raise StopIteration
    return self.take()

  def close(self) -> None:
    """Stops the thread (pending reads are dropped); safe to call twice."""
    self._stop.set()
    with self._cv:
      self._cv.notify()
    while True:
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    self._thread.join(timeout=30)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- the thread -------------------------------------------------------------------
  def _read_one(self, seg: _Segment, images: dict, skip: set, metas: list[TrajMeta]):
    t0 = time.perf_counter()
    payload = self.read(metas, images.keys() | skip if self._reuse_images else skip)
    nbytes = payload.nbytes_read  # sequences, plus only the image copies read just now
    for iid, image in payload.images.items():
      images[iid] = image
      self.stats.images_read[iid] += 1
    if seg.read_images:
      payload.images = {iid: images[iid] for m in payload.metas for iid in m.image_ids}
    self.stats.bytes_read += nbytes
    if self.unit_host is not None and self.host is not None:
      self.stats.bytes_local += sum(m.length * 9 for m in payload.metas  # int32+float32+uint8
                                    if self.unit_host.get(m.unit) == self.host)
    self.stats.rows_read.update(m.id for m in payload.metas)
    batch = seg.prepare(payload)
    if self.put is not None:
      batch = self.put(batch)
    self.stats.raw_transfer_s += time.perf_counter() - t0
    return batch

  def _next_segment(self) -> _Segment | None:
    with self._cv:
      while not self._segments and not self._ended and not self._stop.is_set():
        self._cv.wait()
      return self._segments.popleft() if self._segments and not self._stop.is_set() else None

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _run(self):
    while (seg := self._next_segment()) is not None:
      images: dict = {}
      # Without images (the encode-once path reads each image once, into its slot),
      # every image id of the segment counts as read already.
      skip = set() if seg.read_images else {i for m in seg.plan for x in m for i in x.image_ids}
      jobs = ([("image slots", None)] if seg.first is not None else []) + list(enumerate(seg.plan))
      for k, metas in jobs:
        try:
          if metas is None:
            t0 = time.perf_counter()
            item = seg.first(self.read)
            self.stats.raw_transfer_s += time.perf_counter() - t0
          else:
            item = self._read_one(seg, images, skip, metas)
        except Exception as e:  # surfaces in the step that needs this item
          if metas is None:
            item = DataReadError(f"reading the image slots failed: {e}")
          else:
            units, rows = sorted({m.unit for m in metas}), [m.id for m in metas]
            item = DataReadError(f"reading micro-batch {k} (units {units}, rows {rows[:4]}"
                                 f"{'...' if len(rows) > 4 else ''}) failed: {e}")
          item.__cause__ = e
        if not self._put(item) or isinstance(item, Exception):
          return
