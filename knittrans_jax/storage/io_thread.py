"""A background thread that writes a local unit's tokens while its writer does the rest.

An append to a local unit (storage/unit_writer.py) is mostly system calls: the
in-place writes of its tokens into their chunk file, and the replacement of the
`rows` and `reward` chunks (a new file each, renamed into place). Python releases
the GIL inside each, so the tokens' writes run here while the writer replaces the
others and makes the metadata records, on a second core where there is one. The
writer waits for every write, this one included, before its commit marker, as
before: nothing about what a crash or a failure leaves changes.

One thread per process, shared by its writers, in submission order. A forked child
starts its own on first use (the parent's thread does not exist there).
"""
from __future__ import annotations

import os
import queue
import threading

ENABLED = False  # True: used by the writer (see the docs: it costs where cores are busy)


class Job:
  """A call run on the thread; `result()` waits for it, then returns its result's
  `result()` (a write's future) or raises what it raised."""

  __slots__ = ("_fn", "_args", "_done", "_value", "_error")

  def __init__(self, fn, args):
    self._fn, self._args, self._value, self._error = fn, args, None, None
    self._done = threading.Lock()
    self._done.acquire()  # released when the call has run

  def run(self) -> None:
    try:
      self._value = self._fn(*self._args)
    except BaseException as e:  # handed to the writer, which reports it
      self._error = e
    finally:
      self._fn = self._args = None
      self._done.release()

  def wait(self) -> None:
    with self._done:
      pass

  def result(self):
    self.wait()
    if self._error is not None:
      raise self._error
    return self._value.result()


_start = threading.Lock()
_queue: queue.SimpleQueue | None = None
_pid: int | None = None


def submit(fn, *args) -> Job:
  """Runs fn(*args) on the thread (started on first use in this process)."""
  global _queue, _pid
  if _pid != os.getpid():
    with _start:
      if _pid != os.getpid():
        _queue = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(_queue,), name="knittrans-store-io",
                         daemon=True).start()
        _pid = os.getpid()
  job = Job(fn, args)
  _queue.put(job)
  return job


def _serve(jobs: queue.SimpleQueue) -> None:
  while True:
    jobs.get().run()
