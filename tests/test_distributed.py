"""The trainer as 2 Ray trainer actors under jax.distributed equals one process on the
same data (cluster/trainer_actors.py; the driver is this test process), through the
loss of one of them: trainer 1 is SIGKILLed after step 3, the group is rebuilt on a
new port and the run resumes from the step-2 checkpoint (cluster/ray_job.py)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import gin
import jax
import numpy as np
import pytest

from knittrans_jax import gin_cli
from knittrans_jax.job.distributed import ProcessSetup, initialize
from knittrans_jax.job.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_process_setup_errors():
  with pytest.raises(ValueError, match="coordinator_address"):
    initialize(ProcessSetup(None, 2, 0))
  with pytest.raises(ValueError, match="process_id = 2"):
    ProcessSetup("localhost:1", 2, 2)
  with pytest.raises(ValueError, match="num_processes = 0"):
    ProcessSetup(None, 0, 0)


@pytest.fixture(scope="module")
def two_process_run(local_ray, tmp_path_factory):
  from knittrans_jax.launch import run as run_job
  run = tmp_path_factory.mktemp("dist") / "run"
  # 2 trainer actors x 4 CPU devices, FSDP over all 8 (parameters split across the
  # processes, so each publishes only its shards), 2 rollout actors.
  gin_cli.parse(argparse.Namespace(
      gin_file=["configs/text_grpo_test.gin", "configs/mesh/fsdp.gin"], workdir=str(run),
      gin_bindings=["JobConfig.train_batches = 2", "JobConfig.cluster = 'ray'",
                    "RayConfig.trainers = 2", "RayConfig.devices_per_trainer = 4",
                    "RayConfig.trainer_strategy = 'PACK'",
                    # Held-out evaluation in the driver, on the weights the actors publish.
                    "EvalConfig.every_steps = 2", "EvalConfig.prompts_per_source = 2",
                    # Replayed after the run (job/replay.py): every row kept.
                    "StoreSchema.retention = 'all'"]))
  killed = []

  def kill_trainer1():  # once step 3 is recorded: steps 1-2 are in the step-2 checkpoint
    deadline = time.time() + 300
    while time.time() < deadline:
      if len(read_metrics(str(run), partial=True)) >= 3:
        killed.append(int((run / "logs" / "trainer1.pid").read_text()))
        os.kill(killed[0], signal.SIGKILL)
        return
      time.sleep(0.05)
  threading.Thread(target=kill_trainer1, daemon=True).start()
  summary = run_job(str(run))
  gin.clear_config()
  assert killed and summary["trainer_rebuilds"] == 1, summary
  assert int((run / "logs" / "trainer1.pid").read_text()) != killed[0]  # a new actor
  return run


@pytest.mark.slow
def test_two_trainer_processes_equal_one(two_process_run, tmp_path):
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.job.replay import replay, run_state
  from knittrans_jax.job.setup import job_setup

  run = two_process_run
  summary = json.loads((run / "summary.json").read_text())
  assert summary["steps"] == 4 and summary["quota_violations"] == 0
  records = read_metrics(str(run))
  trained = [i for r in records for i in r["ids"]]
  # As an uninterrupted run: every mini-batch of both train batches once, in order
  # (the killed run's step 3 was rolled back with its checkpoint and trained again).
  assert [(r["train_batch"], r["index"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  assert len(trained) == len(set(trained)) == 4 * 16

  # Each process of the rebuilt group read only its own consumer's rows: disjoint
  # halves of what steps 3-4 trained.
  reads = [json.loads((run / "logs" / f"trainer{p}.json").read_text())["read_ids"]
           for p in range(2)]
  resumed = [i for r in records[2:] for i in r["ids"]]
  assert len(reads[0]) == len(reads[1]) == len(resumed) // 2
  assert not set(reads[0]) & set(reads[1])
  assert sorted(reads[0] + reads[1]) == sorted(resumed)

  # One process, 8 devices, the same mini-batches from the run's store.
  gin.parse_config_file(str(run / "config.gin"))
  job = replay(job_setup(JobConfig()), str(run), str(tmp_path / "replay"), consumers=2)
  assert [r["ids"] for r in job.log.records] == [r["ids"] for r in records]
  for a, b in zip(records, job.log.records):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-5)
  state = run_state(str(run), job.trainer.state)
  assert int(state.version) == int(job.trainer.state.version) == 4
  # Two processes sum the gradient in another order than one. Adam divides by
  # sqrt(v) + eps, so an element whose gradient is near zero can turn that rounding
  # into an update difference far above float epsilon. Hence: all but a few elements
  # equal to 1e-6, and every element within 1% of one Adam step (lr = 1e-2); a
  # process that trained on the wrong rows moves nearly every element by ~lr.
  diffs = np.concatenate([
      np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).ravel()
      for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(job.trainer.state.params))])
  assert diffs.max() <= 1e-4, diffs.max()
  assert np.mean(diffs > 1e-6) <= 1e-3, np.mean(diffs > 1e-6)
  # Non-zero gradients: the parameters moved, so equality is not the trivial one.
  assert max(r["grad_norm"] for r in records) > 1e-2

  # Held-out evaluation ran on Ray (in the driver, on the published weights of both
  # processes' shards): at steps 2 and 4, and what it reported at step 4 is the
  # evaluation of the run's final parameters, evaluated again here.
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.job.setup import job_setup, make_evaluator
  assert [r["step"] for r in records if r.get("eval")] == [2, 4]
  assert summary["eval_start"] is not None and summary["eval_train_overlap"] == 0
  evaluator = make_evaluator(job_setup(JobConfig()), job.trainer.fns.graphdef)
  assert evaluator(jax.device_get(state.params), 4) == summary["eval_last"]


@pytest.mark.slow
def test_job_quarantines_a_damaged_unit_and_trains_the_rest(two_process_run, tmp_path):
  """The run's mini-batches again, after one unit's first sequences chunk is deleted:
  the job goes on, skipping exactly that chunk's rows."""
  import shutil

  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.job.replay import replay
  from knittrans_jax.job.setup import job_setup
  from knittrans_jax.storage import TrajectoryStore

  run = tmp_path / "damaged"
  shutil.copytree(two_process_run, run)
  store = TrajectoryStore.open(f"file://{run}/store")
  metas = store.list_committed("worker1")
  chunk = store.schema.token_chunk
  os.remove(run / "store" / "worker1" / "sequences" / "c" / "0")
  hit = [m for m in metas if m.token_start < chunk]
  gin.parse_config_file(str(run / "config.gin"))
  job = replay(job_setup(JobConfig()), str(run), str(tmp_path / "replay"), consumers=2)
  records = job.log.records
  assert len(records) == 4
  trained = {i for r in records for i in r["ids"]}
  lost = [m for m in hit if m.id in trained]
  assert lost, "the damaged chunk held no trained row"
  assert sum(r["tokens_skipped"] for r in records) == sum(m.response_len for m in lost)
  assert set(job.quarantine.quarantined) == {"worker1"}
  assert set(job.quarantine.bad_rows) == {m.id for m in lost}


def test_overwrite_and_resume_exclude_each_other(tmp_path, monkeypatch, capsys):
  import importlib.util
  (tmp_path / "keep").mkdir()
  spec = importlib.util.spec_from_file_location("train", os.path.join(ROOT, "scripts", "train.py"))
  train = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(train)
  monkeypatch.setattr(sys, "argv", ["train.py", "--workdir", str(tmp_path / "keep"),
                                    "--overwrite", "--resume"])
  with pytest.raises(SystemExit) as out:
    train.main()
  assert out.value.code == 2 and "exclude each other" in capsys.readouterr().err
  assert (tmp_path / "keep").exists()  # nothing was deleted


def _bench_cluster():
  from script_helpers import load_script
  return load_script("bench_cluster")


def test_bench_cluster_cpu_split_attributes_threads():
  """bench_cluster's split of two /proc samples: Ray's daemons, Ray's threads in our
  processes (named native ones, Python ones started by Ray), ours (main threads, XLA's,
  Python threads of our modules) and threads that exited in between (a process's total
  less its live threads)."""
  bench = _bench_cluster()
  driver, actor, gcs = 100, 200, 300
  start = {(driver, 0): ("driver", "", 10.0), (driver, driver): ("driver", "python", 8.0),
           (driver, 101): ("driver", "worker.io", 1.0),
           (actor, 0): ("RolloutActor", "", 5.0), (actor, actor): ("RolloutActor", "ray::Ro", 1.0),
           (actor, 201): ("RolloutActor", "tf_XLAEigen", 2.0),
           (actor, 202): ("RolloutActor", "ray::IDLE", 1.0),
           (actor, 203): ("RolloutActor", "ray::IDLE", 1.0),
           (gcs, 0): ("gcs_server", "", 1.0), (gcs, gcs): ("gcs_server", "gcs_server", 1.0)}
  end = {(driver, 0): ("driver", "", 14.0), (driver, driver): ("driver", "python", 10.0),
         (driver, 101): ("driver", "worker.io", 1.5),
         (actor, 0): ("RolloutActor", "", 12.0), (actor, actor): ("RolloutActor", "ray::Ro", 1.5),
         (actor, 201): ("RolloutActor", "tf_XLAEigen", 5.0),
         (actor, 202): ("RolloutActor", "ray::IDLE", 2.0),
         (actor, 203): ("RolloutActor", "ray::IDLE", 2.5),
         (gcs, 0): ("gcs_server", "", 1.75), (gcs, gcs): ("gcs_server", "gcs_server", 1.75)}
  registry = {(actor, 202): ("AsyncIO Thread: default", "ray._raylet", "?"),
              (actor, 203): ("Thread-1 (_run)", "knittrans_jax.cluster.rollout_actors",
                             "knittrans_jax.cluster.rollout_actors")}
  split = bench.cpu_split(start, end, registry, ours={driver, actor})
  assert split["total_s"] == pytest.approx(4.0 + 7.0 + 0.75)
  # Ray's: the GCS, the driver's worker.io, the actor's asyncio thread.
  assert split["ray_runtime_s"] == pytest.approx(0.75 + 0.5 + 1.0)
  assert split["ray_runtime_share"] == pytest.approx(2.25 / 11.75)
  assert split["ray_runtime_by_process"] == {"RolloutActor": 1.0, "gcs_server": 0.75,
                                             "driver": 0.5}
  # The driver's 4 CPU-s: its main thread 2, worker.io 0.5, 1.5 in threads that exited.
  assert split["by_thread"]["driver/(exited threads)"] == 1.5
  assert split["by_thread"]["RolloutActor/Thread-1 (_run) [knittrans_jax.cluster.rollout_actors]"] \
      == 1.5
  local = bench.cpu_split(start, end, registry, ours=None)  # a local run: no Ray
  assert "ray_runtime_s" not in local and local["total_s"] == split["total_s"]
