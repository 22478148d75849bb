"""The trainer as 2 processes under jax.distributed equals one process on the same data."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest

from knittrans_jax.job.distributed import ProcessSetup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_process_setup_errors():
  with pytest.raises(ValueError, match="coordinator_address"):
    ProcessSetup(None, 2, 0)
  with pytest.raises(ValueError, match="process_id = 2"):
    ProcessSetup("localhost:1", 2, 2)
  with pytest.raises(ValueError, match="num_processes = 0"):
    ProcessSetup(None, 0, 0)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
  run = tmp_path_factory.mktemp("dist") / "run"
  # 2 trainer processes x 4 CPU devices, FSDP over all 8 (parameters split across
  # the processes, so publishing weights needs the cross-process gather), 2 workers.
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--processes", "2",
         "--devices_per_process", "4", "--", "--gin_file", "configs/text_grpo_test.gin",
         "--gin_file", "configs/mesh/fsdp.gin", "--gin_bindings", "JobConfig.train_batches = 2",
         "--workdir", str(run)]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return run


@pytest.mark.slow
def test_two_trainer_processes_equal_one(two_process_run, tmp_path):
  from knittrans_jax.job.replay import replay, run_state

  run = two_process_run
  summary = json.loads((run / "summary.json").read_text())
  assert summary["steps"] == 4 and summary["quota_violations"] == 0
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  trained = [i for r in records for i in r["ids"]]

  # Each process read only its own consumer's rows: disjoint halves of what trained.
  reads = [json.loads((run / "logs" / f"trainer{p}.json").read_text())["read_ids"]
           for p in range(2)]
  assert len(reads[0]) == len(reads[1]) == len(trained) // 2
  assert not set(reads[0]) & set(reads[1])
  assert sorted(reads[0] + reads[1]) == sorted(trained)

  # One process, 8 devices, the same mini-batches from the run's store.
  gin.parse_config_file(str(run / "config.gin"))
  job = replay(str(run), str(tmp_path / "replay"), consumers=2)
  assert [r["ids"] for r in job.log.records] == [r["ids"] for r in records]
  for a, b in zip(records, job.log.records):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-5)
  state = run_state(str(run), job.trainer.state)
  assert int(state.version) == int(job.trainer.state.version) == 4
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(job.trainer.state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  # Non-zero gradients: the parameters moved, so equality is not the trivial one.
  assert max(r["grad_norm"] for r in records) > 1e-2


@pytest.mark.slow
def test_job_quarantines_a_damaged_unit_and_trains_the_rest(two_process_run, tmp_path):
  """The run's mini-batches again, after one unit's first sequences chunk is deleted:
  the job goes on, skipping exactly that chunk's rows."""
  import shutil

  from knittrans_jax.job.replay import replay
  from knittrans_jax.storage import TrajectoryStore

  run = tmp_path / "damaged"
  shutil.copytree(two_process_run, run)
  store = TrajectoryStore.open(f"file://{run}/store")
  metas = store.list_committed("worker1")
  chunk = store.schema.token_chunk
  os.remove(run / "store" / "worker1" / "sequences" / "c" / "0")
  hit = [m for m in metas if m.token_start < chunk]
  gin.parse_config_file(str(run / "config.gin"))
  job = replay(str(run), str(tmp_path / "replay"), consumers=2)
  records = job.log.records
  assert len(records) == 4
  trained = {i for r in records for i in r["ids"]}
  lost = [m for m in hit if m.id in trained]
  assert lost, "the damaged chunk held no trained row"
  assert sum(r["tokens_skipped"] for r in records) == sum(m.response_len for m in lost)
  assert set(job.quarantine.quarantined) == {"worker1"}
  assert set(job.quarantine.bad_rows) == {m.id for m in lost}


def test_launcher_reports_a_failed_process(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--processes", "2",
         "--devices_per_process", "1", "--", "--gin_file", "configs/text_grpo_test.gin",
         "--gin_bindings", "JobConfig.no_such_knob = 1", "--workdir", str(tmp_path / "run")]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert "exited with code" in out.stderr and "no_such_knob" in out.stderr + out.stdout
  (tmp_path / "keep").mkdir()
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"), "--",
         "--workdir", str(tmp_path / "keep"), "--overwrite", "--resume"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and "exclude each other" in out.stderr
  assert (tmp_path / "keep").exists()  # nothing was deleted
