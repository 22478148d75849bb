"""The job through drops, stalls, failed steps and restarts (issue 15's defects, each
reproduced against the real job first): resume after zero-signal and stale drops
finishes; colocated mode replaces dropped groups; a hung worker stops the run with a
named error; a step that fails, then --resume, keeps every train batch whole."""
import argparse
import contextlib
import collections
import os
import signal
import time

import psutil
import pytest
from test_job import check_trained, finish, records, start, wait_for_steps

from knittrans_jax import gin_cli
from knittrans_jax.storage import TrajectoryStore

pytestmark = pytest.mark.slow


def trained_groups(workdir):
  store = TrajectoryStore.open("file://" + os.path.join(os.path.abspath(workdir), "store"))
  by_group = collections.defaultdict(list)
  for m in store.list_committed():
    by_group[m.group_id].append(m)
  return [by_group[g] for r in records(workdir) for g in r["groups"]]


def test_resume_after_zero_signal_and_stale_drops_finishes(tmp_path):
  # Before the fix: dropped groups were fed again on resume and filled the window,
  # so nothing was dispatched and the resumed run spun forever.
  work = tmp_path / "run"
  drops = ["TrainBatchSpec.drop_zero_signal = True", "TrainBatchSpec.max_staleness = 1",
           "JobConfig.train_batches = 4"]
  proc = start(work, *drops)
  wait_for_steps(work, 3, proc)
  proc.send_signal(signal.SIGINT)
  assert "interrupted" in finish(proc)
  finish(start(work, *drops, resume=True), timeout=300)
  summary, recs = check_trained(work, 8)
  assert summary["groups"]["zero_signal"] + summary["groups"]["stale"] > 0, summary["groups"]
  for metas in trained_groups(work):  # no zero-signal group trained
    assert len({m.reward for m in metas}) > 1
  # Every trained trajectory was at most eta = 1 versions behind (plus its j).
  assert max(a for r in recs for a in r["arch"]) <= 1


def test_colocated_replaces_dropped_groups(tmp_path):
  # Before the fix: a dropped group was never replaced, admission waited forever.
  work = tmp_path / "run"
  finish(start(work, "JobConfig.mode = 'colocated'", "TrainBatchSpec.drop_zero_signal = True",
               "JobConfig.train_batches = 2"), timeout=300)
  summary, recs = check_trained(work, 4)
  assert summary["groups"]["zero_signal"] > 0 and summary["arch_staleness_mean"] == 0
  assert all(len({m.reward for m in metas}) > 1 for metas in trained_groups(work))


def test_a_hung_worker_stops_the_run_with_a_named_error(tmp_path):
  work = tmp_path / "run"
  proc = start(work, "JobConfig.workers = 1", "JobConfig.stall_timeout_s = 4")
  deadline = time.time() + 120
  worker = None
  while worker is None and time.time() < deadline and proc.poll() is None:
    worker = next((c for c in psutil.Process(proc.pid).children()
                   if "spawn_main" in " ".join(c.cmdline())), None)
    time.sleep(0.05)
  assert worker is not None, "no worker process appeared"
  worker.suspend()  # SIGSTOP while it still compiles: alive but silent, as a hung worker is
  try:
    out, _ = proc.communicate(timeout=120)
  finally:
    with contextlib.suppress(psutil.NoSuchProcess):
      worker.kill()  # the job kills it at close; this is for a failed test
  assert proc.returncode != 0
  assert "JobStalled" in out and "stall_timeout_s = 4" in out, out[-3000:]
  assert "short sources none; in flight {" in out and "rollout: worker 0: 16 groups" in out
  # The run stopped cleanly: its checkpoint and summary inputs are there to --resume.
  assert (work / "checkpoints").exists() and (work / "operative_config.gin").exists()


def _parse(workdir, *bindings):
  gin_cli.parse(argparse.Namespace(gin_file=["configs/text_grpo_test.gin"],
                                   gin_bindings=list(bindings), workdir=str(workdir)))


def test_a_failed_step_then_resume_keeps_train_batches_whole(tmp_path, monkeypatch):
  # Before the fix: the final save recorded the admission position of the mini-batch
  # that failed, so on resume its train batch ran M - 1 mini-batches.
  from knittrans_jax.job.run import Job
  from knittrans_jax.job.trainer import Trainer
  work = tmp_path / "run"
  bindings = ["JobConfig.train_batches = 3", "CheckpointConfig.every_steps = 100"]
  real_step, calls = Trainer.step, []

  def failing(self, w, apply=True):
    calls.append(w.key)
    if len(calls) == 4:  # train batch 1, mini-batch 1: read ahead, then fails inside
      raise RuntimeError("injected failure inside step 4")
    return real_step(self, w, apply)
  monkeypatch.setattr(Trainer, "step", failing)
  _parse(work, *bindings)
  with pytest.raises(RuntimeError, match="injected failure"):
    Job(str(work)).run()
  assert calls[-1] == (1, 1) and [(r["train_batch"], r["index"]) for r in records(work)] == [
      (0, 0), (0, 1), (1, 0)]
  assert (work / "operative_config.gin").exists()  # written at set-up, before the failure
  monkeypatch.setattr(Trainer, "step", real_step)
  _parse(work, *bindings)
  summary = Job(str(work), resume=True).run()
  assert summary["steps"] == 6
  check_trained(work, 6)
  assert [(r["train_batch"], r["index"]) for r in records(work)] == [
      (k, j) for k in range(3) for j in range(2)]


def test_sampler_and_loss_temperatures_must_agree(tmp_path):
  from knittrans_jax.job.run import Job
  _parse(tmp_path / "run", "LossConfig.temperature = 0.7")
  with pytest.raises(ValueError, match=r"LossConfig.temperature = 0.7 differs from "
                                       r"SamplerConfig.temperature = 1.0"):
    Job(str(tmp_path / "run"))
  assert not (tmp_path / "run" / "store").exists()  # refused before anything was created


def test_window_too_small_for_train_batch_admission_is_refused(tmp_path):
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.admission import TrainBatchSpec
  spec = TrainBatchSpec(group_size=4, groups_per_batch=8, num_mini_batches=2)
  with pytest.raises(ValueError, match="window = 6 .* G = 8"):
    JobConfig(spec=spec, policy="train_batch", window=6, micro_batch_size=8)
  JobConfig(spec=spec, policy="constraint_preserving", window=6, micro_batch_size=8)  # g = 4
