"""Which unique images a mini-batch encodes, who reads each, and where rows find them.

Pure Python over metadata. Input: the data plane's micro-batch plan,
`consumers[c][k]` = consumer c's k-th micro-batch (TrajMeta lists); every row
carries exactly one image id. Output: the mini-batch's image slots, laid out
consumer by consumer (consumer c owns slots c*S .. c*S + S-1, so with the slot
axis split over the batch shards each consumer's images land on its own devices);
each unique image sits in exactly one slot, owned by the consumer with most rows
using it (ties: the one owning fewest so far, then the lowest index); and for every
row its slot index. An image used by several consumers or micro-batches is still
read once and encoded once; the others reach its embedding through the gather.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

from knittrans_jax.types import TrajMeta


class ImagePlanError(ValueError):
  """A mini-batch the encode-once step cannot take; names the trajectory."""


@dataclasses.dataclass(frozen=True)
class ImagePlan:
  slots: tuple[str | None, ...]  # image id per slot; None pads
  slots_per_consumer: int
  owned: tuple[tuple[str, ...], ...]  # owned[c]: image ids consumer c reads
  source: dict  # image id -> a TrajMeta that references it (where to read it)
  index: tuple[tuple[tuple[int, ...], ...], ...]  # index[c][k][row]: slot of that row's image

  @property
  def num_unique(self) -> int:
    return sum(s is not None for s in self.slots)

  def consumer_slots(self, c: int) -> tuple[str | None, ...]:
    S = self.slots_per_consumer
    return self.slots[c * S:(c + 1) * S]


def plan_images(consumers: Sequence[Sequence[Sequence[TrajMeta]]], slot_multiple: int = 1,
                min_slots: int = 0) -> ImagePlan:
  """Slots per consumer are the most any consumer owns, at least `min_slots` (fixed
  shapes, no recompiles) and a multiple of `slot_multiple` (the batch shards each
  consumer's slots split over)."""
  if not consumers:
    raise ImagePlanError("no consumers in the micro-batch plan")
  if slot_multiple < 1:
    raise ImagePlanError(f"slot_multiple = {slot_multiple} must be >= 1")
  uses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  source: dict[str, TrajMeta] = {}
  for c, micros in enumerate(consumers):
    for micro in micros:
      for m in micro:
        if len(m.image_ids) != 1:
          raise ImagePlanError(f"trajectory {m.id} has {len(m.image_ids)} images "
                               f"{list(m.image_ids)[:3]}; the encode-once step takes exactly one "
                               "per row")
        iid = m.image_ids[0]
        uses[iid][c] += 1
        source.setdefault(iid, m)
  owned: list[list[str]] = [[] for _ in consumers]
  # Most-shared images first, so the balancing tie-break sees the big decisions first.
  for iid in sorted(uses, key=lambda i: (-sum(uses[i].values()), i)):
    c = min(uses[iid], key=lambda c: (-uses[iid][c], len(owned[c]), c))
    owned[c].append(iid)
  need = max(max(len(o) for o in owned), min_slots, 1)
  S = math.ceil(need / slot_multiple) * slot_multiple
  slots: list[str | None] = []
  for o in owned:
    slots.extend(o + [None] * (S - len(o)))
  where = {iid: i for i, iid in enumerate(slots) if iid is not None}
  index = tuple(tuple(tuple(where[m.image_ids[0]] for m in micro) for micro in micros)
                for micros in consumers)
  return ImagePlan(slots=tuple(slots), slots_per_consumer=S,
                   owned=tuple(tuple(o) for o in owned), source=source, index=index)
