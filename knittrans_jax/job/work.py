"""One optimizer step as the controller hands it to the trainers: metadata only.

    planner = StepPlanner(consumers=C, micro_batch_size=B)
    work = planner(mini_batch)          # StepWork: the plan, advantages, token count
    trainer.step(work)                  # every trainer process, the same work

Pure Python over metadata (no JAX, no payloads): the controller plans, every trainer
process reads and trains its own consumers' share of the plan.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from knittrans_jax.dataplane import plan_micro_batches
from knittrans_jax.dataplane.packing import PackLayout
from knittrans_jax.multimodal.image_plan import ImagePlan, plan_images
from knittrans_jax.rl.advantages import advantages_by_id
from knittrans_jax.types import MiniBatch, TrajMeta


@dataclasses.dataclass(frozen=True)
class StepWork:
  """consumers[c][k]: consumer c's k-th micro-batch; advantages by trajectory id;
  total_tokens: loss tokens of the whole mini-batch (every consumer), the divisor
  of a true global token mean; images: the encode-once slot plan, or None."""
  key: tuple[int, int]  # (train batch k, mini-batch j)
  consumers: tuple[tuple[tuple[TrajMeta, ...], ...], ...]
  advantages: dict[str, float]
  total_tokens: int
  images: ImagePlan | None = None
  local_fraction: float | None = None  # rows read on their unit's host; None: hosts unknown
  # Packed: each trajectory's row in its consumer's micro-batch and the rows per
  # consumer of micro-batch k (dataplane/assignment.py); None: padded.
  rows: tuple[tuple[tuple[int, ...], ...], ...] | None = None
  micro_rows: tuple[int, ...] | None = None

  @property
  def num_micro_batches(self) -> int:
    return len(self.consumers[0])

  @property
  def packed(self) -> bool:
    return self.micro_rows is not None

  def computed_tokens(self, seq_len: int) -> int:
    """Token positions the step computes on, padding included (every consumer)."""
    C = len(self.consumers)
    rows = (sum(self.micro_rows) * C if self.packed else
            sum(len(mb) for micro in self.consumers for mb in micro))
    return rows * seq_len

  def local_rows(self, mine, k: int) -> tuple[int, dict[str, int]]:
    """Packed: the rows of local micro-batch k (the consumers of `mine` side by side)
    and each of its trajectories' row there, by id."""
    per = self.micro_rows[k]
    return per * len(mine), {m.id: j * per + r for j, c in enumerate(mine)
                             for m, r in zip(self.consumers[c][k], self.rows[c][k])}

  def local_micro_batches(self, mine) -> list[tuple[TrajMeta, ...]]:
    """The micro-batches of the consumers in `mine`, side by side: local micro-batch
    k is their k-th micro-batches concatenated (a process's rows of global step k)."""
    return [tuple(m for c in mine for m in self.consumers[c][k])
            for k in range(self.num_micro_batches)]


@dataclasses.dataclass(frozen=True)
class StepPlanner:
  """consumers: data-parallel consumers a mini-batch is split over; micro_batch_size:
  rows of one global micro-batch (all consumers); image_slots: for the encode-once
  step, (slot_multiple, min_slots) so every consumer's slots have one fixed shape
  that splits over its batch shards; None for text or the naive step.
  consumer_host / unit_host: each consumer's host and a unit's host (the one its
  writer registered); with both, a row goes to a consumer on its unit's host where
  the token balance allows (dataplane/assignment.py)."""
  consumers: int
  micro_batch_size: int
  advantage: str = "grpo"  # LossConfig.advantage: the estimator (rl/advantages.py)
  overlong: tuple[int, int] | None = None  # (longest response, LossConfig.overlong_buffer)
  image_slots: tuple[int, int] | None = None
  consumer_host: tuple[str, ...] | None = None
  unit_host: Callable[[str], str] | None = dataclasses.field(default=None, compare=False)
  locality_tolerance: float = 0.05  # consumers divide micro_batch_size: JobConfig.consumers_for
  # Packed micro-batches (JobConfig.packing): rows of a token budget, several
  # trajectories each; micro_batch_size is then the most rows of a micro-batch.
  pack: PackLayout | None = None

  def __call__(self, mb: MiniBatch) -> StepWork:
    plan = plan_micro_batches(mb, self.consumers, self.micro_batch_size // self.consumers,
                              unit_host=self.unit_host, consumer_host=self.consumer_host,
                              tolerance=self.locality_tolerance, pack=self.pack)
    metas = [m for grp in mb.groups for m in grp.metas]
    images = None
    if self.image_slots is not None:
      multiple, min_slots = self.image_slots
      images = plan_images(plan.consumers, slot_multiple=multiple, min_slots=min_slots)
    return StepWork(key=(mb.train_batch, mb.index), consumers=plan.consumers,
                    advantages=advantages_by_id(mb.groups, self.advantage, self.overlong),
                    # the loss tokens (mask 1) as the store counted them
                    total_tokens=sum(m.trained_tokens for m in metas), images=images,
                    local_fraction=(plan.local_fraction if self.unit_host and self.consumer_host
                                    else None),
                    rows=plan.rows, micro_rows=plan.micro_rows)


def image_slots(rows_multiple: int, consumers: int, mini_batch_groups: int) -> tuple[int, int]:
  """(slot_multiple, min_slots) for StepPlanner.image_slots: each process's slots
  split over its batch shards; at least one slot per group of a consumer's share."""
  return (rows_multiple // math.gcd(rows_multiple, consumers),
          -(-mini_batch_groups // consumers))
