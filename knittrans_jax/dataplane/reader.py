"""On-demand, prefetching reads of one consumer's micro-batches.

A background thread walks the consumer's micro-batch plan in order: it reads each
micro-batch straight from the storage units, prepares it (pads to the step's
static shapes), puts it on the devices with the step's sharding, and queues it,
staying up to `depth` micro-batches ahead of the step. The step's side only
waits when the data is not ready yet; that wait is the exposed transfer time.
Each image of the plan is read once per consumer and reused by later micro-batches
(or not at all with read_images=False: the encode-once path reads its image slots
separately, multimodal/slot_reads.py).
A read error is raised in the step that needs that micro-batch, naming its unit
and rows, and the thread stops. With `read=QuarantiningReader(store).read` a
damaged unit is quarantined instead: the micro-batch comes with its intact rows
only (prepare pads the rest), and the skipped rows are in that reader's bad_rows.
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
  waits: list = dataclasses.field(default_factory=list)  # exposed wait per micro-batch
  rows_read: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  images_read: collections.Counter = dataclasses.field(default_factory=collections.Counter)


_DONE = object()


class PrefetchingReader:
  """Iterates prepared micro-batches of `plan` (lists of TrajMeta), in order."""

  def __init__(self, store: TrajectoryStore, plan: Sequence[Sequence[TrajMeta]],
               prepare: Callable[[Payload], Any], depth: int = 2,
               put: Callable[[Any], Any] | None = None,
               unit_host: Mapping[str, str] | None = None, host: str | None = None,
               read_images: bool = True,
               read: Callable[[Sequence[TrajMeta], Any], Payload] | None = None):
    if depth < 1:
      raise ValueError(f"prefetch depth {depth} must be >= 1")
    self.store, self.plan, self.prepare, self.put = store, [list(m) for m in plan], prepare, put
    self._read = read or (lambda metas, skip: store.read(metas, skip_images=skip).result())
    self.unit_host, self.host = unit_host, host
    self.stats = ReaderStats()
    self._images: dict = {}
    # Without images (the encode-once path reads each image once, into its slot),
    # every image id of the plan counts as read already.
    self._skip = set() if read_images else {i for m in self.plan for x in m for i in x.image_ids}
    self.read_images = read_images
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="prefetching-reader", daemon=True)
    self._thread.start()
    self._next = 0

  def _read_one(self, k: int, metas: list[TrajMeta]):
    t0 = time.perf_counter()
    payload = self._read(metas, self._images.keys() | self._skip)
    nbytes = payload.nbytes  # sequences, plus only the images read just now
    for iid, image in payload.images.items():
      self._images[iid] = image
      self.stats.images_read[iid] += 1
    if self.read_images:
      payload.images = {iid: self._images[iid] for m in payload.metas for iid in m.image_ids}
    self.stats.bytes_read += nbytes
    if self.unit_host is not None and self.host is not None:
      self.stats.bytes_local += sum(m.length * 9 for m in payload.metas  # int32+float32+uint8
                                    if self.unit_host.get(m.unit) == self.host)
    self.stats.rows_read.update(m.id for m in payload.metas)
    batch = self.prepare(payload)
    if self.put is not None:
      batch = self.put(batch)
    self.stats.raw_transfer_s += time.perf_counter() - t0
    return batch

  def _run(self):
    for k, metas in enumerate(self.plan):
      if self._stop.is_set():
        return
      try:
        item = self._read_one(k, metas)
      except Exception as e:  # surfaces in the step that needs micro-batch k
        units = sorted({m.unit for m in metas})
        rows = [m.id for m in metas]
        item = DataReadError(f"reading micro-batch {k} (units {units}, rows {rows[:4]}"
                             f"{'...' if len(rows) > 4 else ''}) failed: {e}")
        item.__cause__ = e
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if isinstance(item, Exception):
        return
    self._queue.put(_DONE)

  def __iter__(self):
    return self

  def __next__(self):
    if self._next >= len(self.plan):
      raise StopIteration
    t0 = time.perf_counter()
    item = self._queue.get()
    waited = time.perf_counter() - t0
    self.stats.exposed_wait_s += waited
    self.stats.waits.append(waited)
    if isinstance(item, Exception):
      self.close()
      raise item
    self._next += 1
    self.stats.micro_batches += 1
    return item

  def close(self) -> None:
    """Stops the thread (pending reads are dropped); safe to call twice."""
    self._stop.set()
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
