"""Multi-process writers with a polling reader (writers killed mid-append: tests/faults)."""
import os
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
