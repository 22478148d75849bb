"""The training job end to end: every mode, a worker killed mid-run, SIGINT + resume
(the VLM job: test_vlm_job.py)."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from process_helpers import rollout_workers

from knittrans_jax.job.metrics import read_metrics
from knittrans_jax.storage import TrajectoryStore

pytestmark = pytest.mark.slow


# For tests that read a run's trained rows after it ends: without this their
# retention (StoreSchema.retention = 'trained', the default) reclaims them.
KEEP_ROWS = "StoreSchema.retention = 'all'"


def start(workdir, *bindings, resume=False, gin_file="configs/text_grpo_test.gin"):
  cmd = [sys.executable, "scripts/train.py", "--gin_file", gin_file, "--workdir", str(workdir)]
  for b in bindings:
    cmd += ["--gin_bindings", b]
  if resume:
    cmd.append("--resume")
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=600):
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-4000:]
  return out


def wait_for_steps(workdir, steps, proc, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      pytest.fail(f"the job ended early:\n{proc.stdout.read()[-3000:]}")
    if len(read_metrics(str(workdir), partial=True)) >= steps:
      return
    time.sleep(0.2)
  pytest.fail(f"fewer than {steps} steps after {timeout} s")


def figures_runs():
  """scripts/reproduce_figures.py's runs group."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
  import figures_runs as module
  return module


def check_trained(workdir, expected_steps):
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  recs = read_metrics(str(workdir))
  ids = [i for r in recs for i in r["ids"]]
  assert summary["steps"] == expected_steps == len(recs)
  assert len(ids) == len(set(ids)), "a trajectory was trained twice"
  assert summary["trajectories"] == len(ids) == expected_steps * 16
  store = TrajectoryStore.open("file://" + os.path.join(os.path.abspath(workdir), "store"))
  assert set(ids) <= store.committed_ids(), "trained something that was never committed"
  if store.schema.retention == "trained":  # reclaimed to the last checkpoint's watermarks
    # Held: each unit from its oldest group still in flight, so the window plus the
    # retired groups committed after that one (within a train batch of 16 here).
    held = summary["store"]
    assert 0 <= held["rows_held"] <= held["window_rows"] + 16 < held["rows_committed"], held
    assert held["rows_held_max"] <= held["window_rows"] + 16 + 2 * 16, held  # + a checkpoint
    now = store.footprint()  # as the summary says; the files reclaimed at the end too
    assert {k: held[k] for k in now} == now
  assert summary["quota_violations"] == 0 and summary["tokens_skipped"] == 0
  # Each step's model FLOPs (models/flops.py) over its seconds; no MFU on a CPU. A
  # VLM's steps have none (the formula counts a decoder).
  with open(os.path.join(workdir, "operative_config.gin")) as f:
    vlm = "JobConfig.suite = 'vision'" in f.read()
  for r in recs:
    assert ("model_flops" in r) != vlm and "mfu" not in r
    if not vlm:
      assert r["model_flops"] > 0
      assert r["model_flops_per_s"] == pytest.approx(r["model_flops"] / r["train_s"])
  for key in ("reward_first", "reward_last", "arch_staleness_mean", "arch_staleness_p99",
              "wall_s", "exposed_data_wait_s"):
    assert summary[key] is not None, key
  assert os.path.exists(os.path.join(workdir, "operative_config.gin"))
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tensorboard")))
  return summary, recs


def test_quota_aware_dispatch_and_held_out_evaluation(tmp_path):
  """The job's workers are fed by the quota_aware dispatch: it learns each source's
  generation time from finished groups (one group per worker call, the long
  chain_long source of configs/text_grpo_tails.gin) and keeps every quota. The
  current policy is evaluated on held-out prompts every 4 steps and after the last.
  The loss has a KL term against the initial weights: 0 at the first step, where the
  policy is the reference, and growing once it moves."""
  work = tmp_path / "run"
  finish(start(work, "JobConfig.dispatch = 'quota_aware'", "QuotaAware.min_samples = 2",
               "LossConfig.kl_coef = 0.1",
               "TrainBatchSpec.source_quota = {'nearest': 3, 'count': 3, 'chain_long': 2}",
               "JobConfig.groups_per_call = 1",
               "EvalConfig.every_steps = 4", "EvalConfig.prompts_per_source = 4"))
  summary, recs = check_trained(work, 6)
  est = summary["dispatch_estimates_s"]
  assert summary["dispatch"] == "quota_aware" and set(est) == {"nearest", "count", "chain_long"}
  assert all(v is not None and v > 0 for v in est.values()), est
  evals = {r["step"]: r["eval"] for r in recs if "eval" in r}
  assert sorted(evals) == [4, 6]
  assert all(set(e) == {"greedy", "sampled"} and all(0 <= v <= 1 for v in e.values())
             for e in evals.values())
  assert summary["eval_last"] == evals[6]
  # The initial policy too, and no evaluation prompt was a training prompt.
  assert set(summary["eval_start"]) == {"greedy", "sampled"}
  assert summary["eval_train_overlap"] == 0
  kl = [r["kl"] for r in recs]  # the warmup's first update has learning rate 0
  assert kl[0] == 0.0 and min(kl) >= 0 and kl[-1] > kl[2] > 0, kl


@pytest.mark.parametrize("mode,policy,data_path", [
    ("disaggregated", "constraint_preserving", "ondemand"),
    ("colocated", "train_batch", "centralized"),
    ("synchronous", "train_batch", "ondemand")])
def test_end_to_end(tmp_path, mode, policy, data_path):
  work = tmp_path / "run"
  finish(start(work, f"JobConfig.mode = '{mode}'", f"JobConfig.policy = '{policy}'",
               f"JobConfig.data_path = '{data_path}'",
               *([KEEP_ROWS] if mode == "synchronous" else [])))
  summary, recs = check_trained(work, 6)
  assert summary["mode"] == mode and summary["policy"] == policy
  # The trainer reads through the on-demand PrefetchingReader: its timings are reported.
  assert summary["raw_transfer_s"] > 0 and summary["exposed_data_wait_s"] >= 0
  if mode != "disaggregated":
    assert summary["arch_staleness_mean"] == 0 and all(a == 0 for r in recs for a in r["arch"])
  if mode == "synchronous":  # the workers generated every train batch k with version k*M
    store = TrajectoryStore.open("file://" + os.path.join(os.path.abspath(work), "store"))
    metas = {m.id: m for m in store.list_committed()}
    assert {i.split("/")[0] for r in recs for i in r["ids"]} <= {"worker0", "worker1"}
    assert all(metas[i].version_first == r["train_batch"] * 2 for r in recs for i in r["ids"])
  if mode == "colocated":
    # A second run into the same work dir, without --resume, is refused.
    proc = start(work, f"JobConfig.mode = '{mode}'")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "holds a previous run" in out
  # The figures script reads the same numbers from the run (reproduce_figures.py runs).
  figures = figures_runs()
  r = figures.runs_figures({policy: figures.run_result(str(work))}, str(tmp_path))[policy]
  assert r["arch_mean"] == pytest.approx(summary["arch_staleness_mean"]) and r["steps"] == 6
  assert (tmp_path / "learning_curves.png").stat().st_size > 0
  assert (tmp_path / "runs_staleness.png").stat().st_size > 0


def test_worker_killed_mid_run(tmp_path):
  work = tmp_path / "run"
  proc = start(work, "JobConfig.train_batches = 4")
  wait_for_steps(work, 3, proc)
  workers = rollout_workers(proc.pid)
  assert len(workers) == 2, [c.cmdline() for c in psutil.Process(proc.pid).children()]
  workers[0].send_signal(signal.SIGKILL)
  out = finish(proc)
  assert "died" in out and "restarting" in out
  check_trained(work, 8)
  # The killed worker's unit is intact and readable.
  store = TrajectoryStore.open("file://" + str(work / "store"))
  for unit in store.units():
    metas = store.list_committed(unit, live=True)
    store.read(metas).result()


def test_sigint_then_resume_trains_the_same_set(tmp_path):
  # Colocated train batch k is groups kG .. kG + G-1 (G = 8 here): an uninterrupted
  # run of 4 train batches trains groups 0 .. 31, each once.
  work = tmp_path / "interrupted"
  proc = start(work, "JobConfig.mode = 'colocated'", "JobConfig.train_batches = 4")
  wait_for_steps(work, 3, proc)
  proc.send_signal(signal.SIGINT)
  out = finish(proc)
  assert "interrupted" in out
  done = len(read_metrics(str(work)))
  assert 3 <= done < 8
  finish(start(work, "JobConfig.mode = 'colocated'", "JobConfig.train_batches = 4", resume=True))
  _, recs = check_trained(work, 8)
  got = sorted(i for r in recs for i in r["ids"])
  # The same groups train, none twice (each group's 4 trajectories train together).
  assert sorted(g for r in recs for g in r["groups"]) == list(range(32))
  assert len(got) == len(set(got)) == 32 * 4
