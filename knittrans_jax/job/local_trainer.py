"""The trainers' handle (job/roles.TrainerHandle) of a local run: the Trainer in this
process. A Ray run's handle (cluster/trainer_actors.RayTrainerGroup) makes each call
on every trainer actor; the driver's loop (job/driver.py) runs over either.
"""
from __future__ import annotations

from knittrans_jax.job.build_trainer import BuiltTrainer
from knittrans_jax.job.trainer import StepResult
from knittrans_jax.job.work import StepWork


class LocalTrainer:

  def __init__(self, built: BuiltTrainer, workdir: str, host: str):
    self.trainer, self.workdir = built.trainer, workdir
    self.progress, self.rows_multiple = built.progress, built.rows_multiple
    self.shared_images = self.trainer.shared_step is not None
    self.consumer_host = (host,) * len(self.trainer.mine)  # every consumer is in this process

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

  def eval_params(self):
    return self.trainer.state.params  # on the devices: the evaluator's sampler takes them

  def save_due(self) -> bool:
    return self.trainer.save_due()

  def save(self, progress: dict, force: bool = False) -> bool:
    return self.trainer.save(progress, force)

  def durable_step(self) -> int | None:
    return self.trainer.durable_step()

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
