"""The controller's handle on the trainer: the in-process one of a local run.

A Ray run's handle (cluster/trainer_actors.RayTrainerGroup) has the same methods
and makes each call on every trainer actor; job/run.py drives either.
"""
from __future__ import annotations

from knittrans_jax.job.trainer import StepResult, Trainer
from knittrans_jax.job.work import StepWork


class LocalTrainer:

  def __init__(self, trainer: Trainer, workdir: str, host: str):
    self.trainer, self.workdir = trainer, workdir
    self.consumer_host = (host,) * len(trainer.mine)  # every consumer is in this process

  @property
  def version(self) -> int:
    return self.trainer.version

  def prefetch(self, work: StepWork) -> None:
    self.trainer.prefetch(work)

  def step(self, work: StepWork) -> StepResult:
    return self.trainer.step(work)

  def publish(self) -> None:
    self.trainer.write_weights()
    self.trainer.commit_weights()

  def save_due(self) -> bool:
    return self.trainer.save_due()

  def save(self, progress: dict, force: bool = False) -> None:
    self.trainer.save(progress, force)

  @property
  def exposed_wait_s(self) -> float:
    return self.trainer.exposed_wait_s

  @property
  def raw_transfer_s(self) -> float:
    return self.trainer.raw_transfer_s

  def finish(self) -> None:
    self.trainer.finish(self.workdir)

  def abort(self, reason: str) -> None:
    self.trainer.close()
