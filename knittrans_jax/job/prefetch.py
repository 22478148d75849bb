"""The trainer's stream of prepared micro-batches, read ahead of compute.

The trainer feeds jobs, each a label and a function that reads one item (a
micro-batch, or the encode-once image slots), prepares it and puts it on the
devices. `Prefetcher` runs them in order on one background thread, up to `depth`
items ahead of the step, so the next mini-batch is read while the current one
trains and no first micro-batch waits on a new reader's start. The step's side
only waits when the item is not ready yet; that wait is the exposed transfer time.
`Inline` runs each job when its item is taken: the centralized baseline, where
nothing overlaps compute and all of it is exposed.

A job's error is raised, as DataReadError naming the job's label, in the step that
needs that item, and the stream stops.
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Sequence

from knittrans_jax.cpu_profile import phase
from knittrans_jax.dataplane.reader import DataReadError
from knittrans_jax.job.config import PREFETCH_DEPTH

ReadTask = tuple[str, Callable[[], Any]]  # (what it reads, for errors; the work)


@dataclasses.dataclass
class StreamStats:
  exposed_wait_s: float = 0.0  # the step waited for an item that was not ready
  raw_transfer_s: float = 0.0  # reads + preparation + host-to-device, summed
  taken: int = 0
  waits: list = dataclasses.field(default_factory=list)  # exposed wait per item taken


def _run_job(label: str, fn: Callable[[], Any]):
  try:
    with phase("store_read"):  # read, prepare, put on the devices
      return fn()
  except Exception as e:  # surfaces in the step that needs this item
    err = DataReadError(f"reading {label} failed: {e}")
    err.__cause__ = e
    return err


class Prefetcher:
  """Runs fed jobs in order on one thread, `depth` items ahead (see module doc)."""

  def __init__(self, depth: int = PREFETCH_DEPTH):
    if depth < 1:
      raise ValueError(f"prefetch depth {depth} must be >= 1")
    self.stats = StreamStats()
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._jobs: collections.deque[ReadTask] = collections.deque()
    self._cv = threading.Condition()
    self._stop = threading.Event()
    self._fed = 0
    self._failed: Exception | None = None
    self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
    self._thread.start()

  def feed(self, jobs: Sequence[ReadTask]) -> None:
    with self._cv:
      self._jobs.extend(jobs)
      self._fed += len(jobs)
      self._cv.notify()

  def ready(self) -> bool:
    """Whether the next item can be taken without waiting."""
    return not self._queue.empty()

  def take(self):
    """The next item (blocks until it is read)."""
    if self._failed is not None:
      raise DataReadError(f"the reader stopped after an earlier error: {self._failed}")
    if self.stats.taken >= self._fed:
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
    self.stats.taken += 1
    return item

  def close(self) -> None:
    """Stops the thread (pending jobs are dropped); safe to call twice."""
    self._stop.set()
    with self._cv:
      self._cv.notify()
    while True:
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    self._thread.join(timeout=30)

  def _next_job(self) -> ReadTask | None:
    with self._cv:
      while not self._jobs and not self._stop.is_set():
        self._cv.wait()
      return None if self._stop.is_set() else self._jobs.popleft()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _run(self):
    while (job := self._next_job()) is not None:
      t0 = time.perf_counter()
      item = _run_job(*job)
      self.stats.raw_transfer_s += time.perf_counter() - t0
      if not self._put(item) or isinstance(item, Exception):
        return


class Inline:
  """The same stream with nothing read ahead: a job runs when its item is taken."""

  def __init__(self):
    self.stats = StreamStats()
    self._jobs: collections.deque[ReadTask] = collections.deque()

  def feed(self, jobs: Sequence[ReadTask]) -> None:
    self._jobs.extend(jobs)

  def ready(self) -> bool:
    return False

  def take(self):
    if not self._jobs:
      raise RuntimeError("take(): nothing fed; feed() first")
    t0 = time.perf_counter()
    item = _run_job(*self._jobs.popleft())
    waited = time.perf_counter() - t0
    self.stats.exposed_wait_s += waited
    self.stats.raw_transfer_s += waited
    self.stats.waits.append(waited)
    if isinstance(item, Exception):
      raise item
    self.stats.taken += 1
    return item

  def close(self) -> None:
    self._jobs.clear()
