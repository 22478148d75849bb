"""A writer SIGKILLed while it appends and reclaims, trial after trial on one unit,
while a consumer reads every row as it is committed and the low watermark follows
it (a window of rows behind what the consumer has read, as a controller retires
trained rows): every acknowledged group must be read intact once, by the consumer
before its rows were reclaimed or from the unit at the end; a restarted writer
finishes any reclamation the kill interrupted; no chunk below what the unit keeps
is left behind; and a reclaimed row asked for is a ReclaimedRowError, never
another row's bytes."""
from __future__ import annotations

import collections
import dataclasses
import os
import signal
import time

import numpy as np

from knittrans_jax.faults.accounting import Outcome, PollingReader, acked_groups, start_writer
from knittrans_jax.faults.data import SCHEMA, mismatches
from knittrans_jax.storage import TrajectoryStore
from knittrans_jax.storage import layout as L
from knittrans_jax.storage.retention import (ReclaimedRowError, Records, chunk_geometry,
                                             chunk_key)

# Small chunks, so that reclamation deletes (and recycles) chunk files all the time.
RECLAIM_SCHEMA = dataclasses.replace(SCHEMA, token_chunk=512, row_chunk=16,
                                     retention="trained")
WINDOW_ROWS = 32  # rows kept behind what the consumer has read


def _left_behind(store: TrajectoryStore, unit: str) -> list[str]:
  """Chunk keys below what the unit keeps (its `reclaimed` floors): must be none."""
  url = L.join(store.url, unit)
  floors, prev = Records(unit, url).floors()
  if floors != prev:
    return [f"unfinished reclamation {prev} -> {floors}"]
  arrays = L.open_unit_arrays(url, store.schema, create=False,
                              names=set(L.unit_arrays(url, store.schema)) - {"commit"})
  kv = L.open_kvstore(url, L.context(False))
  keys = {k.decode() for k in kv.list().result()}
  left = []
  for name, keep in floors.keep().items():
    if name not in arrays:  # `reward` before format 6 only
      continue
    c, ndim = chunk_geometry(name, arrays[name])
    left += [key for k in range(keep // c) if (key := chunk_key(name, k, ndim)) in keys]
  return left


def run(root: str, trials: int = 10, seed: int = 5, n: int = 4,
        store_url: str | None = None) -> Outcome:
  url = store_url or f"file://{os.path.abspath(root)}/store"
  store = TrajectoryStore.create(url, RECLAIM_SCHEMA)
  rng = np.random.default_rng(seed)
  out = Outcome("writer SIGKILL while reclaiming")
  acked: set[int] = set()
  first, interrupted = 0, 0
  reader = PollingReader(store, seed, n)
  records = Records("w0", L.join(store.url, "w0"))

  def follow() -> None:
    """The consumer reads what is new; the watermark follows a window behind it."""
    if reader.poll():
      read = max(m.row for m in reader.seen) + 1
      store.retain_from("w0", max(read - WINDOW_ROWS, 0))

  for t in range(trials):
    proc = start_writer(url, "w0", seed, first, 10_000, n, reclaim_every_s=0.0)
    proc.wait_for_line(timeout=60)
    kill_at = time.monotonic() + float(rng.uniform(0.1, 0.5))
    while time.monotonic() < kill_at:
      follow()
      time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    stdout, _ = proc.communicate(timeout=60)
    got = acked_groups(stdout)
    acked |= got
    now, prev = records.floors()
    interrupted += now != prev  # killed between recording a reclamation and finishing it
    follow()
    live = store.list_committed("w0", live=True)
    first = max([m.group_id for m in live] + list(got) + [first - 1]) + 1
    out.trials += 1
  store.writer("w0", reclaim_every_s=0.0).reclaim()  # a reopened writer finishes, then catches up
  reader.check(out)  # every row the consumer read, intact, once
  # Rows still held read back intact; acknowledged groups read by neither are lost.
  live = store.list_committed("w0", live=True)
  bad = set(mismatches(store.read(live).result(), seed, n)) if live else set()
  intact = {(m.group_id, m.index_in_group) for m in live if m.id not in bad}
  intact |= {(m.group_id, m.index_in_group) for m in reader.seen if m.id not in reader.bad}
  out.written = store.reader("w0").commit().rows
  out.trained = len(intact)
  out.lost += sum((g, i) not in intact for g in acked for i in range(n)) + len(bad)
  keys = collections.Counter((m.group_id, m.index_in_group) for m in live)
  out.duplicated += sum(c - 1 for c in keys.values())
  left = _left_behind(store, "w0")
  if left:
    out.errors.append(f"left behind below the floors: {left[:5]}")
  w = store.reader("w0").watermark()
  try:
    store.read([m for m in reader.seen if m.row == w - 1])
    out.errors.append(f"row {w - 1} (below the watermark {w}) was read")
  except ReclaimedRowError as e:
    out.errors.append(f"row {e.row} of unit '{e.unit}' refused: below the watermark "
                      f"{e.watermark}")
  out.errors.append(f"{interrupted} of {trials} kills came mid-reclamation; "
                    f"{w} of {out.written} rows reclaimed")
  return out
