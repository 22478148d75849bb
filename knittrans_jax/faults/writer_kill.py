"""Rollout writer SIGKILLed mid-write, at a random moment, trial after trial on the
same unit, while a consumer polls the store and reads every row it lists: every
acknowledged group must be there, whole and exactly once, the consumer never sees
a partial or wrong row, and a restarted writer continues the unit."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from knittrans_jax.faults.accounting import (Outcome, PollingReader, acked_groups, check_store,
                                             start_writer)
from knittrans_jax.faults.data import SCHEMA
from knittrans_jax.storage import TrajectoryStore


def run(root: str, trials: int = 20, seed: int = 3, n: int = 4,
        store_url: str | None = None) -> Outcome:
  """`store_url`: where the store lives (default file://ROOT/store)."""
  url = store_url or f"file://{os.path.abspath(root)}/store"
  store = TrajectoryStore.create(url, SCHEMA)
  rng = np.random.default_rng(seed)
  out = Outcome("rollout writer SIGKILL mid-write")
  acked: set[int] = set()
  first = 0
  reader = PollingReader(store, seed, n)
  for t in range(trials):
    proc = start_writer(url, "w0", seed, first, 10_000, n)
    proc.wait_for_line(timeout=60)  # the first ack: appends are under way
    kill_at = time.monotonic() + float(rng.uniform(0.0, 0.3))  # then die anywhere inside one
    while time.monotonic() < kill_at:
      if not reader.poll():
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=60)
    got = acked_groups(stdout)
    acked |= got
    # The next writer starts after whatever the killed one may have committed.
    committed = store.list_committed("w0")
    first = max([m.group_id for m in committed] + list(got) + [first - 1]) + 1
    out.trials += 1
  result = check_store(store, seed, n, acked)
  out.written, out.trained, out.lost, out.duplicated = (result.written, result.trained,
                                                        result.lost, result.duplicated)
  reader.check(out)
  return out
