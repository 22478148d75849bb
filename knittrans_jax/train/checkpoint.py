"""Orbax checkpoints of the train state plus the data path's progress.

Saved every `every_steps` optimizer steps (asynchronously: training goes on while
the write finishes), keeping the last `keep`. A checkpoint holds the params, the
optimizer state, the version and an opaque JSON blob (e.g. which
trajectories were consumed) so a resumed run neither repeats nor skips data.
"""
from __future__ import annotations

import dataclasses
import os

import gin
import jax
import orbax.checkpoint as ocp

from knittrans_jax.train.state import TrainState


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 50
  keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    # orbax divides by the interval: 0 would fail at the first save, not here.
    if not isinstance(self.every_steps, int) or self.every_steps < 1:
      raise ValueError(f"CheckpointConfig.every_steps = {self.every_steps!r} must be an int >= 1 "
                       "(the run's last step is always saved: a large value saves only that)")
    if not isinstance(self.keep, int) or self.keep < 1:
      raise ValueError(f"CheckpointConfig.keep = {self.keep!r} must be an int >= 1")


class Checkpointer:

  def __init__(self, directory: str, config: CheckpointConfig | None = None):
    """`config`: the run's saving cadence (JobSetup.checkpoint); None opens the
    directory to read (restore, latest step) and never saves or deletes."""
    self.directory = os.path.abspath(directory)  # orbax needs an absolute path
    options = (ocp.CheckpointManagerOptions(read_only=True) if config is None else
               ocp.CheckpointManagerOptions(
                   save_interval_steps=config.every_steps, max_to_keep=config.keep,
                   enable_async_checkpointing=config.async_save))
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "progress"))
    # Steps saved by this process, and the one found on disk (a resumed run's).
    self._saved = [s for s in [self._manager.latest_step()] if s is not None]

  def save(self, state: TrainState, progress: dict, force: bool = False,
           step: int | None = None) -> bool:
    """Saves at `step` (default: the state's version, read from the device) if it is
    due (or `force`); returns whether it did."""
    step = int(jax.device_get(state.version)) if step is None else step
    if step == self._manager.latest_step():
      return False  # already saved at this version (e.g. a periodic save, then the final one)
    saved = self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state._asdict()), progress=ocp.args.JsonSave(progress)),
        force=force)
    if saved:
      self._saved.append(step)
    return saved

  def durable_step(self) -> int | None:
    """The latest step whose checkpoint is wholly written (None: none yet). An
    asynchronous save still writing is not; orbax runs one at a time."""
    done = self._saved[:-1] if self._manager.is_saving_in_progress() else self._saved
    return done[-1] if done else None

  def should_save(self, step: int) -> bool:
    return self._manager.should_save(step)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore(self, target: TrainState, step: int | None = None):
    """(state, progress) of the latest (or given) checkpoint, sharded like `target`
    (a TrainState of ShapeDtypeStructs with shardings); None if there is none."""
    step = self._manager.latest_step() if step is None else step
    if step is None:
      return None
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target._asdict()), progress=ocp.args.JsonRestore()))
    except Exception:
      saved = self._manager.item_metadata(step).state
      extra = sorted(set(saved or {}) - set(TrainState._fields))
      if extra:  # a checkpoint of an older TrainState (before 2026-12-03 it had `rng`)
        raise ValueError(f"checkpoint {self.directory}/{step} holds train-state field(s) "
                         f"{extra} that TrainState {TrainState._fields} no longer has: it "
                         "was written by an older knittrans_jax; resume it with that "
                         "version or start a fresh run") from None
      raise
    return TrainState(**out.state), out.progress

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
