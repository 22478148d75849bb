"""Rollout writer SIGKILLed mid-write, at a random moment, trial after trial on the
same unit: every acknowledged group must be there, whole and exactly once; a
restarted writer continues the unit."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from knittrans_jax.faults.accounting import Outcome, acked_groups, check_store, start_writer
from knittrans_jax.faults.data import SCHEMA
from knittrans_jax.storage import TrajectoryStore


def run(root: str, trials: int = 20, seed: int = 3, n: int = 4) -> Outcome:
  url = f"file://{os.path.abspath(root)}/store"
  store = TrajectoryStore.create(url, SCHEMA)
  rng = np.random.default_rng(seed)
  out = Outcome("rollout writer SIGKILL mid-write")
  acked: set[int] = set()
  first = 0
  for t in range(trials):
    proc = start_writer(url, "w0", seed, first, 10_000, n)
    proc.wait_for_line(timeout=60)  # the first ack: appends are under way
    time.sleep(float(rng.uniform(0.0, 0.3)))  # then die anywhere inside one
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
  return out
