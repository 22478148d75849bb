"""A run on Ray (JobConfig.cluster = 'ray'): connect, run the job with this process as
the driver, and bring a lost trainer group back.

A trainer actor that dies takes the group down (cluster/trainer_actors.py): every
actor of the run is stopped, and the job starts again from its last checkpoint,
exactly as `--resume` would (the controller's window, unit watermarks and admission
position come back with it; groups committed since are read back from the store),
with new trainer actors on a new coordinator port. At most
RayConfig.trainer_restarts times, then the last loss is raised.
"""
from __future__ import annotations

import json
import os
import time

from knittrans_jax.cluster.ray_setup import RayConfig, connect
from knittrans_jax.cluster.trainer_actors import TrainerLost


def run_on_ray(workdir: str, resume: bool = False, log=print) -> dict:
  from knittrans_jax.job.run import Job
  cfg = RayConfig()
  t0 = time.perf_counter()
  started = connect(cfg, workdir, log=log)
  lost = []
  try:
    for attempt in range(cfg.trainer_restarts + 1):
      try:
        job = Job(workdir, resume or attempt > 0, role="driver", ray_cfg=cfg)
        summary = job.run()
      except TrainerLost as e:
        lost.append(str(e))
        if attempt == cfg.trainer_restarts:
          raise RuntimeError(f"the trainer group was lost {len(lost)} times, more than "
                             f"RayConfig.trainer_restarts = {cfg.trainer_restarts}; last: {e}") from e
        log(f"\n{e}\nrebuilding the trainer group and resuming from the last checkpoint "
            f"({cfg.trainer_restarts - attempt} rebuilds left)")
        continue
      summary.update(cluster="ray", trainer_rebuilds=len(lost),
                     ray_wall_s=time.perf_counter() - t0)
      with open(os.path.join(job.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
      return summary
  finally:
    if started:
      import ray
      ray.shutdown()
  raise AssertionError("unreachable")
