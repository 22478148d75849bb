"""Reads that survive a damaged unit: the unit is quarantined, its intact rows and
every other unit are still used.

A batched read that fails with CorruptUnitError marks the failing unit quarantined
(the error, naming the unit, is kept). From then on that unit's rows are read one
at a time, and a row that fails is set aside (`bad_rows`, with its error) instead of
failing the whole read. Other units keep the batched path.

The payload's `image_bytes_read` sums what the successful reads moved: without
dedup every trajectory's own copy, and a quarantined unit's images once per row
read (a failed read's bytes are not known, so not counted).
"""
from __future__ import annotations

from typing import Sequence

from knittrans_jax.storage.errors import CorruptUnitError
from knittrans_jax.storage.store import TrajectoryStore
from knittrans_jax.types import Payload, TrajMeta


class QuarantiningReader:

  def __init__(self, store: TrajectoryStore):
    self.store = store
    self.quarantined: dict[str, str] = {}  # unit -> the first error it raised
    self.bad_rows: dict[str, str] = {}  # trajectory id -> its error

  def read(self, metas: Sequence[TrajMeta], skip_images=()) -> Payload:
    """The payload of the intact rows among `metas`, in their order (images in
    `skip_images`, already held by the caller, are not read)."""
    healthy = [m for m in metas if m.unit not in self.quarantined]
    parts = {}
    moved = 0  # image bytes of the reads that succeeded

    def read(ms):
      nonlocal moved
      p = self.store.read(ms, skip_images).result()
      moved += p.image_nbytes_read
      parts.update(self._by_id(p))

    try:
      read(healthy)
    except CorruptUnitError as e:
      self.quarantined.setdefault(e.unit, str(e))
      by_unit: dict[str, list[TrajMeta]] = {}
      for m in healthy:
        by_unit.setdefault(m.unit, []).append(m)
      for unit, ms in by_unit.items():
        if unit in self.quarantined:
          continue
        try:
          read(ms)
        except CorruptUnitError as e2:
          self.quarantined.setdefault(unit, str(e2))
    for m in metas:  # quarantined units: row by row
      if m.unit in self.quarantined and m.id not in parts and m.id not in self.bad_rows:
        try:
          read([m])
        except CorruptUnitError as e:
          self.bad_rows[m.id] = str(e)
    good = [m for m in metas if m.id in parts]
    images = {}
    for m in good:
      images.update({i: parts[m.id][3][i] for i in m.image_ids if i in parts[m.id][3]})
    return Payload(metas=good, tokens=[parts[m.id][0] for m in good],
                   logprobs=[parts[m.id][1] for m in good],
                   loss_mask=[parts[m.id][2] for m in good], images=images,
                   image_bytes_read=moved)

  @staticmethod
  def _by_id(p: Payload) -> dict:
    return {m.id: (t, lp, mk, p.images) for m, t, lp, mk in zip(p.metas, p.tokens, p.logprobs,
                                                                 p.loss_mask)}
