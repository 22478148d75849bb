"""Packing: a consumer's trajectories into rows of a token budget, rows into micro-batches.

Pure Python over lengths. A packed micro-batch is `rows` rows of `row_tokens` tokens,
each row several whole trajectories back to back (segments), so the step computes
on tokens, not on padding (job/batching.build_packed_batch builds the arrays; the decoder attends
within a segment only).

    layout = PackLayout(row_tokens=528, max_rows=8, row_unit=1)
    micro = pack_micro_batches(lengths_by_consumer, layout)
    micro[k].rows            # rows every consumer's k-th micro-batch has (lockstep)
    micro[k].items[c]        # consumer c's items in it: (item index, row) pairs

Rows are filled first-fit decreasing (each trajectory, longest first, into the
first row with room: at most 11/9 OPT + 6/9 rows, Dosa 2007). A consumer's rows are
cut into micro-batches of at most `max_rows`; the consumers step in lockstep, so a
mini-batch has as many micro-batches as the consumer with the most rows needs, and
micro-batch k's row count is the most any consumer's k-th holds, rounded up to
`row_unit` x a power of two (capped at `max_rows`): the step compiles for a few row
counts, not one per mini-batch. A consumer with fewer rows gets empty rows.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class PackLayout:
  """row_tokens: tokens per packed row (JobConfig.seq_len); max_rows: rows of one
  consumer's micro-batch at most; row_unit: a consumer's row count is a multiple of
  it (its rows split over the batch shards it owns); prefix_tokens: positions every
  trajectory takes in its row before its own tokens (the toy VLM's image embeddings,
  models/vlm.py; 0 for text and Qwen-VL, whose image tokens are in the sequence)."""
  row_tokens: int
  max_rows: int
  row_unit: int = 1
  prefix_tokens: int = 0

  def __post_init__(self):
    if min(self.row_tokens, self.max_rows, self.row_unit) <= 0 or self.prefix_tokens < 0:
      raise ValueError(f"PackLayout: row_tokens {self.row_tokens}, max_rows {self.max_rows} and "
                       f"row_unit {self.row_unit} must be positive, prefix_tokens "
                       f"{self.prefix_tokens} not negative")
    if self.max_rows % self.row_unit:
      raise ValueError(f"PackLayout: max_rows {self.max_rows} is not a multiple of row_unit "
                       f"{self.row_unit}")

  def rows_for(self, need: int) -> int:
    """The row count a micro-batch needing `need` rows is compiled for."""
    rows = self.row_unit
    while rows < need:
      rows *= 2
    return min(rows, self.max_rows)

  def shapes(self) -> list[int]:
    """Every row count `rows_for` can give: the step's packed shapes."""
    return sorted({self.rows_for(n) for n in range(1, self.max_rows + 1)})


@dataclasses.dataclass(frozen=True)
class PackedMicroBatch:
  """rows: rows per consumer; items[c]: consumer c's (item index, row) pairs."""
  rows: int
  items: tuple[tuple[tuple[int, int], ...], ...]


class TooLongError(ValueError):
  """A trajectory longer than a packed row."""


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[int]:
  """The row of each item (rows numbered in the order they open)."""
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  free: list[int] = []
  row = [0] * len(lengths)
  for i in order:
    if lengths[i] > capacity:
      raise TooLongError(f"item {i} of {lengths[i]} tokens does not fit a row of {capacity}")
    for r, room in enumerate(free):
      if room >= lengths[i]:
        break
    else:
      r = len(free)
      free.append(capacity)
    free[r] -= lengths[i]
    row[i] = r
  return row


def pack_micro_batches(lengths: Sequence[Sequence[int]], layout: PackLayout
                       ) -> list[PackedMicroBatch]:
  """Consumer c's items (their token lengths `lengths[c]`) packed into rows and cut
  into lockstep micro-batches (module doc). Every item appears exactly once."""
  rows_of = [first_fit_decreasing(ls, layout.row_tokens) for ls in lengths]
  counts = [max(r, default=-1) + 1 for r in rows_of]
  K = max((-(-n // layout.max_rows) for n in counts), default=0)
  out = []
  for k in range(K):
    lo = k * layout.max_rows
    need = max(min(max(n - lo, 0), layout.max_rows) for n in counts)
    items = tuple(tuple((i, r - lo) for i, r in enumerate(rows)
                        if lo <= r < lo + layout.max_rows) for rows in rows_of)
    out.append(PackedMicroBatch(layout.rows_for(need), items))
  return out
