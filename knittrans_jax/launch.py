"""The entry point: runs the job where JobConfig.cluster says (scripts/train.py).

    summary = run(workdir, resume)

'local' runs job/local.py (this process trains, rollout workers are its children);
'ray' runs cluster/ray_job.py (this process drives Ray's trainer and rollout actors).
Both run the same loop, job/driver.py. This module sits above job/ and cluster/ so that
job/ never imports cluster/. It is the root: the run's configs are built here, once,
from gin (job/setup.py's JobSetup) and passed down.
"""
from __future__ import annotations

from knittrans_jax import compile_cache
from knittrans_jax.cluster.ray_setup import RayConfig  # gin's, without importing Ray
from knittrans_jax.job.config import JobConfig
from knittrans_jax.job.local import run_local
from knittrans_jax.job.setup import job_setup


def run(workdir: str, resume: bool = False) -> dict:
  """Trains to JobConfig.train_batches where JobConfig.cluster says; returns the summary."""
  cfg = JobConfig()
  compile_cache.enable(cfg.compilation_cache)  # before anything compiles
  setup = job_setup(cfg)
  if cfg.cluster == "ray":
    from knittrans_jax.cluster.ray_job import run_on_ray  # Ray is imported only for Ray runs
    return run_on_ray(setup, RayConfig(), workdir, resume)
  return run_local(setup, workdir, resume)
