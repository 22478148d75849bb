"""What a scenario reports, and how the store's contents are checked against the
groups writers acknowledged."""
from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
import threading
from typing import Iterable

from knittrans_jax.faults.data import group, mismatches
from knittrans_jax.storage import StoreError, TrajectoryStore


@dataclasses.dataclass
class Outcome:
  scenario: str
  trials: int = 0
  written: int = 0  # trajectories committed to the store
  trained: int = 0  # trajectories a consumer read back intact (or a trainer trained)
  lost: int = 0  # acknowledged or committed, then unreadable, wrong or missing
  duplicated: int = 0  # the same (group, index) more than once
  quarantined: int = 0  # rows reported corrupt and set aside (by design, not lost)
  errors: list = dataclasses.field(default_factory=list)  # the clear errors raised

  def add(self, other: "Outcome") -> None:
    for f in ("trials", "written", "trained", "lost", "duplicated", "quarantined"):
      setattr(self, f, getattr(self, f) + getattr(other, f))
    self.errors += other.errors

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class DrainedProcess:
  """A child process whose stdout and stderr are read by threads as they come.

  A parent that reads a child's pipes only after it exits deadlocks once the child
  has written a pipe buffer's worth (64 KiB on Linux) of output: the child blocks in
  write and never exits. Draining as it goes keeps the child free to print.
  """

  def __init__(self, cmd: list[str], env: dict | None = None):
    self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env)
    self._out: list[str] = []
    self._err: list[str] = []
    self._cv = threading.Condition()
    self._stdout_closed = False
    self._threads = [threading.Thread(target=self._drain, args=(pipe, lines), daemon=True)
                     for pipe, lines in ((self.proc.stdout, self._out),
                                         (self.proc.stderr, self._err))]
    for t in self._threads:
      t.start()

  def _drain(self, pipe, lines: list[str]) -> None:
    for line in pipe:
      with self._cv:
        lines.append(line)
        self._cv.notify_all()
    pipe.close()
    with self._cv:
      self._stdout_closed |= lines is self._out
      self._cv.notify_all()

  @property
  def returncode(self) -> int | None:
    return self.proc.returncode

  def poll(self) -> int | None:
    return self.proc.poll()

  def send_signal(self, sig: int) -> None:
    self.proc.send_signal(sig)

  def wait_for_line(self, timeout: float) -> None:
    """Blocks until the child has printed a line to stdout; an error if it ends first."""
    with self._cv:
      if not self._cv.wait_for(lambda: self._out or self._stdout_closed, timeout=timeout):
        raise TimeoutError(f"{self.proc.args[:4]}... printed nothing in {timeout} s")
      if not self._out:
        raise RuntimeError(f"{self.proc.args[:4]}... ended without printing: "
                           f"{''.join(self._err)[-300:]}")

  def communicate(self, timeout: float) -> tuple[str, str]:
    """Waits for exit and for both pipes to close; returns all of stdout and stderr."""
    self.proc.wait(timeout=timeout)
    for t in self._threads:
      t.join(timeout=timeout)
    with self._cv:
      return "".join(self._out), "".join(self._err)


class PollingReader:
  """A consumer beside the writers: lists newly committed rows (StoreWatcher) and
  reads them at once, checking each against its source. `bad`: rows read wrong."""

  def __init__(self, store: TrajectoryStore, seed: int, n: int):
    self.store, self.seed, self.n = store, seed, n
    self.watcher = store.watch()
    self.seen, self.bad = [], []

  def poll(self) -> int:
    new = self.watcher.poll()
    if new:
      self.bad += mismatches(self.store.read(new).result(), self.seed, self.n)
      self.seen += new
    return len(new)

  def check(self, out: Outcome) -> None:
    """Adds what the reader saw wrong, twice or not at all to `out` (after a last poll)."""
    if not self.seen:
      out.errors.append("the polling reader read no rows while the writers ran")
    self.poll()
    ids = [m.id for m in self.seen]
    out.lost += len(self.bad)
    out.duplicated += len(ids) - len(set(ids))
    if set(ids) != self.store.committed_ids():
      out.errors.append("the polling reader's view differs from the final listing")


def append_until_failure(writer, seed: int, n: int, limit: int = 100_000):
  """Appends groups 0, 1, ... until an append raises StoreError. Returns the acknowledged
  groups, the group whose append failed and the error (None if `limit` was reached)."""
  acked, gid = set(), 0
  while gid < limit:
    try:
      writer.append(group(seed, gid, n))
    except StoreError as e:
      return acked, gid, e
    acked.add(gid)
    gid += 1
  return acked, gid, None


def start_writer(url: str, unit: str, seed: int, first: int, count: int, n: int,
                 seconds: float | None = None, env: dict | None = None,
                 reclaim_every_s: float | None = None) -> DrainedProcess:
  cmd = [sys.executable, "-m", "knittrans_jax.faults.writer_proc", url, unit, str(seed),
         str(first), str(count), str(n)]
  if seconds is not None:
    cmd.append(str(seconds))
  if reclaim_every_s is not None:
    cmd += ["--reclaim_every_s", str(reclaim_every_s)]
  return DrainedProcess(cmd, env={**os.environ, **(env or {})})


def acked_groups(stdout: str) -> set[int]:
  return {int(line.split()[1]) for line in stdout.splitlines() if line.startswith("ack ")}


def check_store(store: TrajectoryStore, seed: int, n: int, acked: Iterable[int],
                units: Iterable[str] | None = None) -> Outcome:
  """Reads every committed row back: counts intact rows, acknowledged groups whose rows
  are missing or wrong (lost) and repeated (group, index) pairs (duplicated)."""
  out = Outcome("check")
  units = list(units) if units is not None else store.units()
  metas = [m for u in units for m in store.list_committed(u)]
  out.written = len(metas)
  keys = collections.Counter((m.group_id, m.index_in_group) for m in metas)
  out.duplicated = sum(c - 1 for c in keys.values())
  bad = set(mismatches(store.read(metas).result(), seed, n)) if metas else set()
  out.trained = len(metas) - len(bad)
  good_keys = {(m.group_id, m.index_in_group) for m in metas if m.id not in bad}
  out.lost = sum((g, i) not in good_keys for g in set(acked) for i in range(n))
  return out
