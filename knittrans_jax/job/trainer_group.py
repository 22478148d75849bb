"""The controller's handle on every trainer process, and the followers' loop.

With one process these are plain calls on the local trainer. Under jax.distributed,
process 0 sends each call as a message (metadata only, job/distributed.PlanChannel)
and then makes it itself; every other process runs `follow`, which makes the same
call on its own trainer. One message type per Trainer method, so a mini-batch can
be followed from the controller (`TrainerGroup.step`) into `Trainer.step` on every
process.
"""
from __future__ import annotations

import dataclasses
import signal

from knittrans_jax.job.distributed import PlanChannel
from knittrans_jax.job.trainer import StepResult, Trainer
from knittrans_jax.job.work import StepWork


@dataclasses.dataclass(frozen=True)
class Prefetch:
  work: StepWork


@dataclasses.dataclass(frozen=True)
class Step:
  key: tuple[int, int]  # the work was sent with Prefetch


@dataclasses.dataclass(frozen=True)
class Publish:
  pass


@dataclasses.dataclass(frozen=True)
class Save:
  force: bool


@dataclasses.dataclass(frozen=True)
class Finish:
  pass


@dataclasses.dataclass(frozen=True)
class Abort:
  reason: str


class TrainerGroup:
  """(process 0) Every call runs on all trainer processes."""

  def __init__(self, trainer: Trainer, channel: PlanChannel, workdir: str):
    self.trainer, self.channel, self.workdir = trainer, channel, workdir

  @property
  def version(self) -> int:
    return self.trainer.version

  def prefetch(self, work: StepWork) -> None:
    self.channel.send(Prefetch(work))
    self.trainer.prefetch(work)

  def step(self, work: StepWork) -> StepResult:
    self.channel.send(Step(work.key))
    return self.trainer.step(work)

  def publish(self) -> None:
    self.channel.send(Publish())
    self.trainer.publish()

  def save_due(self) -> bool:
    return self.trainer.save_due()

  def save(self, progress: dict, force: bool = False) -> None:
    self.channel.send(Save(force))
    self.trainer.save(progress, force)

  def finish(self) -> None:
    self.channel.send(Finish())
    self.trainer.finish(self.workdir)

  def abort(self, reason: str) -> None:
    """A failure here, maybe mid-step: no collective call now; the others stop."""
    self.channel.send(Abort(reason))
    self.trainer.close()


def follow(trainer: Trainer, channel: PlanChannel, workdir: str) -> None:
  """(processes > 0) Makes process 0's calls on this trainer until it finishes."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # process 0 decides when the run stops
  while True:
    msg = channel.receive()
    if isinstance(msg, Prefetch):
      trainer.prefetch(msg.work)
    elif isinstance(msg, Step):
      trainer.step(trainer.pending(msg.key))
    elif isinstance(msg, Publish):
      trainer.publish()
    elif isinstance(msg, Save):
      trainer.save({}, msg.force)
    elif isinstance(msg, Finish):
      trainer.finish(workdir)
      return
    elif isinstance(msg, Abort):
      trainer.close()
      raise RuntimeError(f"process 0 failed ({msg.reason}); process {trainer.process} stops too")
    else:
      raise TypeError(f"unknown trainer message {msg!r}")
