"""When a unit's trained rows may go: the watermarks of each checkpoint, published to
the store once that checkpoint is wholly written (storage/retention.py).

A checkpoint's progress records, per unit, a row below which every group is retired
(ControllerState.watermarks): a run resumed from it lists each unit from there. So
once the checkpoint is durable those rows are never read again, and the unit's writer
may reclaim them. Publishing only then means the watermark never passes what the
last durable checkpoint retired, whatever is killed when. Pure Python over metadata.
"""
from __future__ import annotations

from typing import Callable


class WatermarkPublisher:
  """`publish(unit, row)` raises a unit's low watermark (TrajectoryStore.retain_from)."""

  def __init__(self, publish: Callable[[str, int], int]):
    self._publish = publish
    self._pending: list[tuple[int, dict[str, int]]] = []  # (step, watermarks) saved
    self.published: dict[str, int] = {}

  def saved(self, step: int, watermarks: dict[str, int]) -> None:
    """A checkpoint at `step` was started with these watermarks in its progress."""
    self._pending.append((step, dict(watermarks)))

  def durable(self, step: int | None) -> bool:
    """Checkpoints up to `step` are wholly written: publish the newest one's marks.
    Returns whether a watermark moved."""
    if step is None:
      return False
    ready = [marks for s, marks in self._pending if s <= step]
    if not ready:
      return False
    self._pending = [(s, m) for s, m in self._pending if s > step]
    moved = False
    for unit, row in sorted(ready[-1].items()):
      if row > self.published.get(unit, 0):
        self.published[unit] = self._publish(unit, row)
        moved = True
    return moved

  def all_durable(self) -> None:
    """Every checkpoint saved is written (after the trainers' finish)."""
    if self._pending:
      self.durable(max(s for s, _ in self._pending))
