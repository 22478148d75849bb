"""A run on Ray (JobConfig.cluster = 'ray'): connect, run job/driver.py's loop with this
process as the driver over Ray's trainer and rollout actors, and bring a lost trainer
group back.

A trainer actor that dies takes the group down (cluster/trainer_actors.py): every
actor of the run is stopped, and the job starts again from its last checkpoint,
exactly as `--resume` would (the controller's window, unit watermarks and admission
position come back with it; groups committed since are read back from the store),
with new trainer actors on a new coordinator port. At most
RayConfig.trainer_restarts times, then the last loss is raised.
"""
from __future__ import annotations

import os
import time

import gin
from flax import nnx

from knittrans_jax.cluster.ray_setup import RayConfig, connect
from knittrans_jax.cluster.rollout_actors import RayWorkerPool
from knittrans_jax.cluster.trainer_actors import RayTrainerGroup
from knittrans_jax.job.build_trainer import make_model_fn, step_flops
from knittrans_jax.job.driver import Driver, write_summary
from knittrans_jax.job.roles import TrainerLost
from knittrans_jax.job.setup import (JobSetup, check_new_run, create_store, make_evaluator,
                                     store_url, worker_args)


def _policy_shapes(setup: JobSetup):
  """The policy's graph and parameter shapes, without any array: what the driver's
  held-out evaluation reads the published weights into."""
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: make_model_fn(setup)(nnx.Rngs(0)))
  return nnx.split(model, nnx.Param)


def _attempt(setup: JobSetup, workdir: str, resume: bool, cfg: RayConfig) -> dict:
  job = setup.cfg
  if job.mode == "colocated":
    raise ValueError("JobConfig.mode = 'colocated' with JobConfig.cluster = 'ray': the "
                     "colocated reference generates in the trainer's process; run it "
                     "locally (mode 'synchronous' is its schedule on Ray's workers)")
  consumers = job.consumers_for(cfg.trainers)
  check_new_run(workdir, job, resume)
  url = store_url(workdir, job)
  store = create_store(setup, url)  # before the trainer actors open it
  graphdef, template = _policy_shapes(setup)
  evaluator = make_evaluator(setup, graphdef)  # in this process, on the published weights
  trainers = RayTrainerGroup(cfg, workdir, resume, url, consumers, gin.config_str(),
                             eval_template=template if evaluator is not None else None,
                             weights=setup.weights.resolve("ray"))
  try:
    driver = Driver(setup, workdir, trainers, store, consumers=consumers, resume=resume,
                    evaluator=evaluator, processes=cfg.trainers,
                    flops=step_flops(setup, len(trainers.devices), None))
  except BaseException:
    trainers.close()
    raise
  return driver.run(lambda: RayWorkerPool(
      workdir, store, url, workers=job.workers, worker_args=worker_args(setup), cfg=cfg,
      estimate=driver.dispatch.estimate))


def run_on_ray(setup: JobSetup, cfg: RayConfig, workdir: str, resume: bool = False,
               log=print) -> dict:
  """The run on Ray; `setup` and `cfg`: the root's (launch.py), built once from gin."""
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  t0 = time.perf_counter()
  started = connect(cfg, workdir, log=log)
  lost = []
  try:
    for attempt in range(cfg.trainer_restarts + 1):
      try:
        summary = _attempt(setup, workdir, resume or attempt > 0, cfg)
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
      write_summary(workdir, summary)
      return summary
  finally:
    if started:
      import ray
      ray.shutdown()
  raise AssertionError("unreachable")
