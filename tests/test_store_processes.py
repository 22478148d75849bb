"""Multi-process writers with a polling reader, and writers killed mid-append."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from store_helpers import SOURCES, check_payload

from knittrans_jax.storage import StoreSchema, TrajectoryStore

HERE = os.path.dirname(__file__)
SCHEMA = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=4096, row_chunk=256)


def _start_writer(url, unit, seed, first, count, n):
  env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.Popen(
      [sys.executable, os.path.join(HERE, "store_writer_proc.py"), url, unit, str(seed),
       str(first), str(count), str(n)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_four_writers_and_a_polling_reader(tmp_path):
  url, seed, n = f"file://{tmp_path}/store", 11, 8
  store = TrajectoryStore.create(url, SCHEMA)
  groups_per_writer = 125  # 1000 trajectories each
  procs = [_start_writer(url, f"w{k}", seed, k * groups_per_writer, groups_per_writer, n)
           for k in range(4)]
  watcher, seen, polls = store.watch(), [], 0
  deadline = time.time() + 240
  while len(seen) < 4000:
    assert time.time() < deadline, f"only {len(seen)} of 4000 trajectories after 240 s"
    new = watcher.poll()
    polls += 1
    if new:
      # Every row the reader can see is whole: read it at once, beside the writers.
      check_payload(store.read(new).result(), seed, n)
      seen += new
    elif any(p.poll() not in (None, 0) for p in procs):
      pytest.fail(f"writer failed: {[p.communicate()[1].decode()[-2000:] for p in procs]}")
    else:
      time.sleep(0.01)
  for p in procs:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == b"done", err.decode()[-2000:]
  assert watcher.poll() == [] and not watcher.failed
  assert polls > 4  # the reader really polled while the writers appended
  assert len({m.id for m in seen}) == 4000
  assert sorted((m.group_id, m.index_in_group) for m in seen) == [
      (g, i) for g in range(4 * groups_per_writer) for i in range(n)]
  for k in range(4):
    assert store.reader(f"w{k}").commit().rows == 1000


@pytest.mark.slow
def test_writer_killed_mid_append_leaves_only_whole_rows(tmp_path):
  """SIGKILL at random points: committed rows stay intact; the unit resumes."""
  url, n, trials = f"file://{tmp_path}/store", 4, 20
  store = TrajectoryStore.create(url, SCHEMA)
  rng = np.random.default_rng(0)
  next_group, kills_mid_run, rows_before = 0, 0, 0
  for trial in range(trials):
    # Each trial's writer resumes the same unit at its commit and appends new groups.
    proc = _start_writer(url, "victim", 5, next_group, 10_000, n)
    deadline = time.time() + float(rng.uniform(0.4, 1.2))
    while time.time() < deadline:  # poll beside the writer: never a partial row
      metas = ("victim" in store.units()) and store.reader("victim").list(start=rows_before)
      if metas:
        check_payload(store.read(metas[-8:]).result(), 5, n)
      time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kills_mid_run += proc.returncode == -signal.SIGKILL
    reopened = TrajectoryStore.open(url)
    # A writer killed before registering its unit has committed nothing.
    metas = reopened.list_committed("victim") if "victim" in reopened.units() else []
    assert len(metas) >= rows_before  # nothing committed was lost
    check_payload(store.read(metas).result(), 5, n)  # every committed row intact
    groups = sorted({m.group_id for m in metas})
    # Appends are atomic per call and calls hold whole groups: no group is partial.
    for g in groups:
      assert sum(m.group_id == g for m in metas) == n, f"trial {trial}: group {g} partial"
    next_group = groups[-1] + 1 if groups else 0
    rows_before = len(metas)
  assert kills_mid_run == trials
  assert rows_before > 0, "no writer ever committed a row; the test proves nothing"
