"""The controller's durable state: which groups are out, which are done, where admission is.

Group ids are handed out in increasing order (`next_group`). Every id below it is
either in the *window* (dispatched and not yet retired) or *retired*: trained,
dropped (`zero_signal` or `stale`), or `failed` (its worker was lost before it
committed). So the durable form is `next_group` plus the window, at most W entries
however long the run; the in-flight window of the design notes is `len(window)`.

Per storage unit, `watermarks()` gives a row below which every committed row
belongs to a retired group: a resumed controller lists each unit from there, not
from row 0. `position` is the admission position after the last *trained*
mini-batch, so a mini-batch admitted (and read ahead) but not trained when the run
stopped is admitted again on resume, with the same train-batch index j.

Pure Python; no JAX.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from knittrans_jax.types import TrajMeta

RETIRE_KINDS = ("trained", "zero_signal", "stale", "failed")
FORMAT = 2  # progress written by older code (a list of every consumed id) is refused


class ProgressError(ValueError):
  """A group retired twice, or one that was never dispatched; or unreadable progress."""


@dataclasses.dataclass
class ControllerState:
  next_group: int = 0
  window: dict[int, str] = dataclasses.field(default_factory=dict)  # group id -> source
  retired: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  unit_rows: dict[str, int] = dataclasses.field(default_factory=dict)  # rows seen per unit
  position: dict | None = None  # admission position after the last trained mini-batch
  stream: dict | None = None  # the prompt stream's state
  replace: list[str] = dataclasses.field(default_factory=list)  # sources owed a replacement
  start_rows: dict[str, int] = dataclasses.field(default_factory=dict)  # resume scans start here
  # In memory only: the first row of each finished group still in the window.
  _rows: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict, repr=False)

  def dispatch(self, source: str) -> int:
    gid = self.next_group
    self.next_group += 1
    self.window[gid] = source
    return gid

  def adopt(self, gid: int, source: str) -> None:
    """A group dispatched after the last checkpoint, found committed on resume. The
    ids skipped on the way were dispatched after the checkpoint and never committed:
    they count as failed (their sources are not known; the prompt stream, restored
    to the checkpoint, draws them again)."""
    self.skip_to(gid)
    self.next_group = gid + 1
    self.window[gid] = source

  def skip_to(self, gid: int) -> None:
    """Ids in [next_group, gid) will never be dispatched: retire them as failed."""
    if gid < self.next_group:
      raise ProgressError(f"group {gid} is below next_group {self.next_group}: not new")
    self.retired["failed"] += gid - self.next_group
    self.next_group = gid

  def saw(self, metas: Iterable[TrajMeta]) -> None:
    """Committed rows the controller has listed or been told of."""
    for m in metas:
      self.unit_rows[m.unit] = max(self.unit_rows.get(m.unit, 0), m.row + 1)

  def finished(self, metas: Iterable[TrajMeta]) -> None:
    metas = list(metas)
    gid = metas[0].group_id
    if gid not in self.window:
      raise ProgressError(f"group {gid} finished but is not in the window")
    self.saw(metas)
    first = min(metas, key=lambda m: m.row)
    self._rows[gid] = (first.unit, first.row)

  def retire(self, gid: int, kind: str) -> str:
    """Takes `gid` out of the window; returns its source."""
    if kind not in RETIRE_KINDS:
      raise ProgressError(f"retire kind {kind!r}: use one of {RETIRE_KINDS}")
    if gid not in self.window:
      what = "was never dispatched" if gid >= self.next_group else "is already retired"
      raise ProgressError(f"group {gid} cannot be retired as {kind}: it {what}")
    self._rows.pop(gid, None)
    self.retired[kind] += 1
    return self.window.pop(gid)

  def is_finished(self, gid: int) -> bool:
    return gid in self._rows

  def in_flight(self) -> dict[str, int]:
    """Dispatched groups not yet finished, per source."""
    return dict(collections.Counter(s for g, s in self.window.items() if g not in self._rows))

  def watermarks(self) -> dict[str, int]:
    """Per unit: every committed row below it belongs to a retired group."""
    marks = dict(self.unit_rows)
    for unit, row in self._rows.values():
      marks[unit] = min(marks.get(unit, row), row)
    for unit, row in self.start_rows.items():  # units not listed since the resume
      marks.setdefault(unit, row)
    return marks

  def to_json(self) -> dict:
    return {"format": FORMAT, "next_group": self.next_group,
            "window": {str(g): s for g, s in sorted(self.window.items())},
            "retired": dict(self.retired), "watermarks": self.watermarks(),
            "position": self.position, "stream": self.stream, "replace": list(self.replace)}

  @classmethod
  def from_json(cls, data: dict) -> "ControllerState":
    if data.get("format") != FORMAT:
      raise ProgressError(
          f"checkpoint progress has format {data.get('format')!r}, not {FORMAT}: it was written "
          "by an older version of the job (a list of every consumed id); start a new run")
    return cls(next_group=int(data["next_group"]),
               window={int(g): s for g, s in data["window"].items()},
               retired=collections.Counter(data.get("retired", {})),
               position=data.get("position"), stream=data.get("stream"),
               replace=list(data.get("replace", [])),
               start_rows={u: int(r) for u, r in data.get("watermarks", {}).items()})
