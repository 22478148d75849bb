"""Re-trains a finished run's mini-batches in one process and compares.

  python scripts/replay_check.py runs/dist2            # consumers: the run's process count

For a run with several trainer actors (JobConfig.cluster = 'ray', RayConfig.trainers),
this is the single-process reference on the same trajectories: the run's store, its
logged mini-batches in order, the same plan. Prints per-step loss and gradient norm side by side and the
largest parameter difference against the run's last checkpoint. Exits non-zero if
they differ beyond --rtol / --atol. Needs as many devices as the run's mesh
(XLA_FLAGS=--xla_force_host_platform_device_count=8 on the CPU). The run must have kept
its trained rows: run it with --gin_bindings "StoreSchema.retention = 'all'" (by default
a job reclaims them once a checkpoint covers them: docs/storage.md, "Retention").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import gin
import jax
import numpy as np


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dir")
  parser.add_argument("--consumers", type=int, default=None,
                      help="consumers the run planned over (default: from logs/trainer0.json)")
  parser.add_argument("--rtol", type=float, default=1e-5)
  parser.add_argument("--atol", type=float, default=1e-6)
  args = parser.parse_args()
  from knittrans_jax.job.metrics import read_metrics
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.job.replay import replay, run_state
  from knittrans_jax.job.setup import job_setup

  run = os.path.abspath(args.run_dir)
  consumers = args.consumers
  if consumers is None:
    with open(os.path.join(run, "logs", "trainer0.json")) as f:
      consumers = json.load(f)["consumers"]
  gin.parse_config_file(os.path.join(run, "config.gin"))
  with tempfile.TemporaryDirectory() as work:
    job = replay(job_setup(JobConfig()), run, os.path.join(work, "replay"), consumers)
    logged = read_metrics(run)
    ok = True
    print(f"{'step':>5} {'loss (run)':>14} {'loss (1 proc)':>14} {'grad_norm (run)':>16} "
          f"{'grad_norm (1 proc)':>18}")
    for a, b in zip(logged, job.log.records):
      print(f"{a['step']:>5} {a['loss']:>14.8f} {b['loss']:>14.8f} {a['grad_norm']:>16.8f} "
            f"{b['grad_norm']:>18.8f}")
      ok &= a["ids"] == b["ids"]
      ok &= bool(np.isclose(b["loss"], a["loss"], rtol=args.rtol, atol=args.atol))
    state = run_state(run, job.trainer.state)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(job.trainer.state.params)))
    ok &= all(np.allclose(np.asarray(a), np.asarray(b), rtol=args.rtol, atol=args.atol)
              for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(job.trainer.state.params)))
    ok &= int(state.version) == int(job.trainer.state.version)
  print(f"steps {len(logged)}, consumers {consumers}; largest parameter difference {diff:.3g}: "
        f"{'equal' if ok else 'DIFFERENT'} (rtol {args.rtol}, atol {args.atol})")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
