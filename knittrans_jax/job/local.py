"""A local run (JobConfig.cluster = 'local'): this process is the controller and the
trainer; rollout workers are its child processes (job/workers.py), or, in mode
'colocated', the trainer's own process generates with its current weights.

    summary = run_local(setup, workdir, resume)   # setup: the root's (launch.py)

The loop is job/driver.py's, the same a Ray run drives (cluster/ray_job.py).
"""
from __future__ import annotations

import dataclasses
import os
import socket

import jax

from knittrans_jax.job.build_trainer import BuiltTrainer, Placement, make_trainer, step_flops
from knittrans_jax.job.driver import Driver
from knittrans_jax.job.local_trainer import LocalTrainer
from knittrans_jax.job.roles import RolloutPool
from knittrans_jax.job.setup import (JobSetup, check_new_run, create_store, make_evaluator,
                                     store_url, worker_args)
from knittrans_jax.job.workers import ColocatedPool, WorkerPool, prestart
from knittrans_jax.rollout.groups import rollout_groups


@dataclasses.dataclass
class LocalRun:
  """A local run, set up: `run()` starts the rollout side and trains."""
  driver: Driver
  setup: JobSetup
  store_url: str
  built: BuiltTrainer

  def run(self) -> dict:
    return self.driver.run(self._pool)

  def _pool(self) -> RolloutPool:
    cfg, store, built = self.setup.cfg, self.driver.store, self.built
    if cfg.mode == "colocated":
      trainer, setup = built.trainer, self.setup

      def generate(requests):  # with the trainer's current weights
        return rollout_groups(built.graphdef, trainer.state.params, trainer.version, cfg.seed,
                              requests, cfg.spec.group_size, setup.sampler, setup.suite)
      return ColocatedPool(generate, store.writer("colocated"))
    return WorkerPool(self.driver.workdir, self.store_url, workers=cfg.workers,
                      worker_args=worker_args(self.setup), store=store)


def build_local(setup: JobSetup, workdir: str, resume: bool = False) -> LocalRun:
  """Set-up of a local run, before any worker starts (`setup`: the root's, launch.py):
  configs checked, the store created, the trainer built (and restored on resume)."""
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  cfg = setup.cfg
  if jax.process_count() > 1:
    raise ValueError(f"{jax.process_count()} JAX processes: several trainer processes run as "
                     "Ray actors (JobConfig.cluster = 'ray', RayConfig.trainers; "
                     "docs/distributed.md)")
  consumers = cfg.consumers_for(1)
  check_new_run(workdir, cfg, resume)
  url = store_url(workdir, cfg)
  store = create_store(setup, url)
  host = socket.gethostname()  # as local workers register their units (locality)
  if cfg.mode != "colocated":
    prestart()  # the workers' fork server imports while the trainer is built
  built = make_trainer(setup, workdir, store, Placement(0, 1, consumers, host), resume)
  driver = Driver(setup, workdir, LocalTrainer(built, workdir, host), store,
                  consumers=consumers, resume=resume,
                  evaluator=make_evaluator(setup, built.graphdef),
                  flops=step_flops(setup, built.mesh.devices.size, jax.devices()[0].device_kind))
  return LocalRun(driver, setup, url, built)


def run_local(setup: JobSetup, workdir: str, resume: bool = False) -> dict:
  return build_local(setup, workdir, resume).run()
