"""The trainer process SIGKILLed at a random step, then `--resume`: every trajectory
is consumed exactly once across the restart, and only committed ones.

Checked against the store and the checkpoint: the final metrics hold each trained
id once; every trained id is committed; every step the last checkpoint before the
kill covered is still there, with the same ids (nothing consumed is forgotten).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from knittrans_jax.faults.accounting import Outcome
from knittrans_jax.job.metrics import read_metrics
from knittrans_jax.storage import TrajectoryStore
from knittrans_jax.storage import layout as L


def _start(workdir, gin_file, bindings, resume=False):
  cmd = [sys.executable, "scripts/train.py", "--gin_file", gin_file, "--workdir", workdir]
  for b in bindings:
    cmd += ["--gin_bindings", b]
  if resume:
    cmd.append("--resume")
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)


def _latest_checkpoint(workdir: str) -> int:
  d = os.path.join(workdir, "checkpoints")
  steps = [int(x) for x in os.listdir(d) if x.isdigit()] if os.path.isdir(d) else []
  return max(steps, default=0)


def run(root: str, trials: int = 5, seed: int = 13, train_batches: int = 4,
        gin_file: str = "configs/text_grpo_test.gin", timeout: float = 600,
        store_url: str | None = None) -> Outcome:
  """`store_url`: the trials' stores live under it (default: each in its work dir)."""
  rng = np.random.default_rng(seed)
  out = Outcome("trainer SIGKILL, then --resume")
  for t in range(trials):
    work = os.path.join(os.path.abspath(root), f"trial{t}")
    bindings = [f"JobConfig.train_batches = {train_batches}", "CheckpointConfig.every_steps = 2"]
    url = "file://" + os.path.join(work, "store")  # the job's default
    if store_url:
      url = L.join(store_url, f"trial{t}")
      bindings.append(f"JobConfig.store_url = '{url}'")
    proc = _start(work, gin_file, bindings)
    target = train_batches * 2  # configs/text_grpo_test.gin: 2 mini-batches per train batch
    kill_at = int(rng.integers(2, target - 1))
    deadline = time.time() + timeout
    while len(read_metrics(work, partial=True)) < kill_at and proc.poll() is None and time.time() < deadline:
      time.sleep(0.05)
    time.sleep(float(rng.uniform(0, 0.5)))  # anywhere within the next step
    if proc.poll() is not None:
      out.errors.append(f"trial {t}: the run ended before the kill ({proc.returncode})")
      continue
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its rollout workers
    proc.wait()
    ckpt = _latest_checkpoint(work)
    kept = {r["step"]: sorted(r["ids"]) for r in read_metrics(work, partial=True) if r["step"] <= ckpt}
    resumed = _start(work, gin_file, bindings, resume=True)
    log, _ = resumed.communicate(timeout=timeout)
    if resumed.returncode != 0:
      out.errors.append(f"trial {t}: --resume failed: {log[-500:]}")
      continue
    recs = read_metrics(work, partial=True)
    ids = [i for r in recs for i in r["ids"]]
    # Reclaimed rows (below each unit's watermark) count: they were committed.
    store = TrajectoryStore.open(url)
    committed = store.committed_ids()
    reclaimed = sum(store.reader(u).watermark() for u in store.units())
    out.trials += 1
    out.written += len(committed)
    out.trained += len(set(ids))
    out.duplicated += len(ids) - len(set(ids))
    final = {r["step"]: sorted(r["ids"]) for r in recs}
    out.lost += sum(len(v) for s, v in kept.items() if final.get(s) != v)
    out.lost += len(set(ids) - committed)  # trained but never committed: counted as lost
    if len(recs) != target:
      out.errors.append(f"trial {t}: {len(recs)} steps after resume, expected {target}")
    out.errors.append(f"trial {t}: killed after {kill_at}+ steps, checkpoint at {ckpt}; "
                      f"{reclaimed} of {len(committed)} rows reclaimed after the resumed run")
  return out
