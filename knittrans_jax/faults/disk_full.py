"""The store's disk fills up mid-append: the append fails with a clear error, no
partial row becomes visible, everything committed before stays intact, and once
space is freed the same writer appends again.

The disk is a small tmpfs mounted for the scenario (needs root and mount rights).
Where mounting is not allowed, the file-size limit (RLIMIT_FSIZE, writes fail with
EFBIG) stands in for it; the report says which was used.
"""
from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess

import numpy as np

from knittrans_jax.faults.accounting import Outcome, append_until_failure, check_store
from knittrans_jax.faults.data import SCHEMA, group
from knittrans_jax.storage import StoreError, TrajectoryStore


@contextlib.contextmanager
def small_disk(path: str, size_kib: int):
  """Yields ('tmpfs', path) with a size_kib tmpfs mounted there, or ('rlimit', path)."""
  os.makedirs(path, exist_ok=True)
  ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", path],
                      capture_output=True).returncode == 0
  try:
    yield ("tmpfs" if ok else "rlimit"), path
  finally:
    if ok:
      subprocess.run(["umount", "-l", path], capture_output=True)


@contextlib.contextmanager
def file_size_limit(nbytes: int):
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
  resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)


def run(root: str, trials: int = 3, seed: int = 5, n: int = 4) -> Outcome:
  out = Outcome("store disk full")
  rng = np.random.default_rng(seed)
  for t in range(trials):
    size_kib = int(rng.integers(600, 1400))
    with small_disk(os.path.join(os.path.abspath(root), f"disk{t}"), size_kib) as (kind, path):
      out.scenario = f"store disk full ({kind})"
      url = f"file://{path}/store"
      store = TrajectoryStore.create(url, SCHEMA)
      filler = os.path.join(path, "filler")
      with open(filler, "wb") as f:  # freed after the failure to show recovery
        f.write(b"\0" * (128 << 10))
      writer = store.writer("w0")
      limit = file_size_limit(size_kib << 10) if kind == "rlimit" else contextlib.nullcontext()
      with limit:
        acked, gid, failed = append_until_failure(writer, seed, n)
      if failed is None:
        out.errors.append(f"trial {t}: the disk never filled")
        continue
      out.errors.append(str(failed).splitlines()[0][:200])
      # No partial rows: exactly the acknowledged groups are visible after the failure.
      visible = len(TrajectoryStore.open(url).list_committed("w0"))
      partial = abs(visible - len(acked) * n)
      os.remove(filler)
      try:  # recovery: the same writer continues once there is room
        writer.append(group(seed, gid, n))
        acked.add(gid)
      except StoreError as e:
        out.errors.append(f"trial {t}: no recovery after freeing space: {e}")
      result = check_store(TrajectoryStore.open(url), seed, n, acked)
      out.trials += 1
      out.written += result.written
      out.trained += result.trained
      out.lost += result.lost + partial
      out.duplicated += result.duplicated
  return out
