"""Many writer processes appending at once for a while, with a reader polling the
store beside them: every acknowledged group is read back whole, exactly once."""
from __future__ import annotations

import os
import time

from knittrans_jax.faults.accounting import (Outcome, PollingReader, acked_groups, check_store,
                                             start_writer)
from knittrans_jax.faults.data import SCHEMA
from knittrans_jax.storage import TrajectoryStore


def run(root: str, writers: int = 8, seconds: float = 60.0, seed: int = 7, n: int = 4,
        store_url: str | None = None) -> Outcome:
  """`store_url`: where the store lives (default file://ROOT/store)."""
  url = store_url or f"file://{os.path.abspath(root)}/store"
  store = TrajectoryStore.create(url, SCHEMA)
  span = 1_000_000  # group ids per writer: disjoint ranges
  procs = [start_writer(url, f"w{k}", seed, k * span, span, n, seconds=seconds)
           for k in range(writers)]
  reader = PollingReader(store, seed, n)
  while any(p.poll() is None for p in procs):
    if not reader.poll():  # the consumer reads while the writers append
      time.sleep(0.05)
  out = Outcome(f"{writers} concurrent writers for {seconds:g} s", trials=1)
  acked = set()
  for k, p in enumerate(procs):
    stdout, stderr = p.communicate(timeout=60)
    if p.returncode != 0:
      out.errors.append(f"writer {k} exited {p.returncode}: {stderr[-300:]}")
    acked |= acked_groups(stdout)
  result = check_store(store, seed, n, acked)
  out.written, out.trained, out.duplicated = result.written, result.trained, result.duplicated
  # Lost: acknowledged but not intact at the end, or seen by the polling reader wrong.
  out.lost = result.lost
  reader.check(out)
  return out
