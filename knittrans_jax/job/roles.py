"""The two roles the driver's loop talks to, as protocols, and the events between them.

    RolloutPool     (group id, source) requests in; Finished / Failed events out.
                    Local: job/workers.py (worker processes, or the colocated
                    generator). Ray: cluster/rollout_actors.py.
    TrainerHandle   the trainers as one: prefetch a planned step, run it, publish its
                    weights, checkpoint. Local: job/local_trainer.py (this process).
                    Ray: cluster/trainer_actors.py (one actor per host).

job/driver.py runs the one loop over these; job/local.py and cluster/ray_job.py pick
the implementations. Pure Python; no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from knittrans_jax.job.work import StepWork
from knittrans_jax.types import TrajMeta


class TrainerLost(RuntimeError):
  """A trainer died or hung (on Ray: an actor of the group); the deployment may
  rebuild the trainers and resume from the last checkpoint."""


@dataclasses.dataclass(frozen=True)
class Finished:
  metas: tuple[TrajMeta, ...]  # one committed group, every trajectory
  seconds: float | None = None  # its generation time, if the pool measured it


@dataclasses.dataclass(frozen=True)
class Failed:
  group_id: int
  why: str


class RolloutPool(Protocol):
  # Finished.seconds is the group's time in its engine (excluding the wait in a
  # worker's queue); False: the controller times dispatch-to-done itself.
  timed_generation: bool
  restarts: int  # workers restarted so far (the summary's worker_restarts)

  def can_take(self) -> bool: ...
  def submit(self, group_id: int, source: str) -> None: ...
  def poll(self, timeout: float) -> list[Finished | Failed]: ...
  def describe(self) -> str: ...
  def close(self) -> None: ...


class StepResult(Protocol):
  def fetch(self) -> tuple[dict, float | None]: ...  # (metric sums, grad norm): the host sync


class TrainerHandle(Protocol):
  """Set up (and restored) when handed to the driver: `version` the restored policy
  version, `progress` the controller's saved state (None: a fresh run)."""
  progress: dict | None
  rows_multiple: int  # the mesh's batch shards: rows per micro-batch split this way
  shared_images: bool  # the step shares image slots per mini-batch (encode-once: planned)
  consumer_host: tuple[str, ...]  # each consumer's host (the planner's locality)

  @property
  def version(self) -> int: ...
  def prefetch(self, work: StepWork) -> None: ...
  def step(self, work: StepWork) -> StepResult: ...
  def publish(self) -> None: ...  # the current version, to the rollout engines
  def eval_params(self) -> Any: ...  # the current version's params, for held-out evaluation
  def save_due(self) -> bool: ...
  def save(self, progress: dict, force: bool = False) -> bool: ...  # whether it saved
  def durable_step(self) -> int | None: ...  # the latest checkpoint wholly written
  @property
  def exposed_wait_s(self) -> float: ...
  @property
  def raw_transfer_s(self) -> float: ...
  def finish(self) -> None: ...  # a clean end: wait for checkpoints, write logs
  def abort(self, reason: str) -> None: ...  # a failure: stop without a collective
