"""Consumer assignment: which consumer reads and trains which rows of a mini-batch.

Pure Python over metadata. A mini-batch of B trajectories goes to C data-parallel
consumers, B / C each, as micro-batches of a fixed size (static step shapes; the
consumers step in lockstep). Items are whole GRPO groups when a consumer's share
is a multiple of n, else single trajectories. Items go out largest first to the
least-loaded consumer with room (count-constrained LPT). Locality: an item may go
to a consumer on the host of its storage unit instead, if that keeps the load
within `tolerance` of the mean; if the result is less balanced than
max(tolerance, plain LPT's imbalance), the plain LPT plan is used. Within a
consumer, whole groups (when the micro-batch size is a multiple of n) or else rows
are spread over its micro-batches the same way, by tokens.

Packed (`pack`, a dataplane/packing.PackLayout): a micro-batch is a token budget,
not a row count. Consumers take trajectories by tokens alone (no row count each),
then each consumer's are packed into rows of `row_tokens` and its rows cut into
lockstep micro-batches (dataplane/packing.py); `rows[c][k]` says which packed row
each trajectory of consumer c's micro-batch k goes to, `micro_rows[k]` how many rows
each consumer's micro-batch k has.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Mapping, Sequence

from knittrans_jax.dataplane.packing import PackLayout, TooLongError, pack_micro_batches
from knittrans_jax.types import MiniBatch, TrajMeta


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
  """consumers[c][k] is consumer c's k-th micro-batch (a list of trajectories)."""
  consumers: tuple[tuple[tuple[TrajMeta, ...], ...], ...]
  consumer_tokens: tuple[int, ...]
  imbalance: float  # max consumer tokens / mean - 1
  lpt_imbalance: float  # the same for the plan without locality
  local_fraction: float  # rows whose unit is on the reading consumer's host
  used_locality: bool
  # Packed plans: each trajectory's row in its consumer's micro-batch, and the rows
  # of micro-batch k per consumer (None: padded, a row per trajectory).
  rows: tuple[tuple[tuple[int, ...], ...], ...] | None = None
  micro_rows: tuple[int, ...] | None = None

  @property
  def num_micro_batches(self) -> int:
    return len(self.consumers[0]) if self.consumers else 0


def _imbalance(loads: Sequence[int]) -> float:
  mean = sum(loads) / len(loads)
  return max(loads) / mean - 1.0 if mean > 0 else 0.0


def _spread(items, bins: int, capacity: int, size=lambda it: it[0], prefer=None, slack=0.0):
  """Count-constrained LPT: each bin takes `capacity` items, balanced by size.

  `prefer(item)` names bins to favour when that costs at most `slack` tokens of
  load above the least-loaded choice.
  """
  loads, contents = [0] * bins, [[] for _ in range(bins)]
  for it in sorted(items, key=lambda it: -size(it)):
    open_bins = [b for b in range(bins) if len(contents[b]) < capacity]
    best = min(open_bins, key=lambda b: (loads[b], b))
    if prefer is not None:
      local = [b for b in open_bins if b in prefer(it)]
      if local:
        near = min(local, key=lambda b: (loads[b], b))
        if loads[near] <= loads[best] + slack:
          best = near
    loads[best] += size(it)
    contents[best].append(it)
  return contents, loads


def plan_micro_batches(mini_batch: MiniBatch, num_consumers: int, micro_batch_size: int,
                       unit_host: Mapping[str, str] | Callable[[str], str] | None = None,
                       consumer_host: Sequence[str] | None = None,
                       tolerance: float = 0.05, pack: PackLayout | None = None) -> MicroBatchPlan:
  """Splits a mini-batch into per-consumer micro-batches (see module doc).
  `micro_batch_size`: rows per consumer per micro-batch (padded plans; packed plans
  take theirs from `pack`)."""
  if not mini_batch.groups:
    raise ValueError("mini-batch has no groups")
  metas = [m for grp in mini_batch.groups for m in grp.metas]
  if any(not grp.metas for grp in mini_batch.groups):
    missing = [grp.group_id for grp in mini_batch.groups if not grp.metas][:5]
    raise ValueError(f"groups {missing} carry no trajectory metadata (GroupInfo.metas)")
  if num_consumers <= 0 or micro_batch_size <= 0:
    raise ValueError(f"num_consumers = {num_consumers} and micro_batch_size = "
                     f"{micro_batch_size} must be positive")
  B, C = len(metas), num_consumers
  if pack is not None:
    return _plan_packed(mini_batch, metas, C, pack, unit_host, consumer_host, tolerance)
  if B % (C * micro_batch_size):
    raise ValueError(f"mini-batch of {B} trajectories does not split into {C} consumers x "
                     f"micro-batches of {micro_batch_size}")
  per_consumer = B // C
  if consumer_host is not None and len(consumer_host) != C:
    raise ValueError(f"consumer_host has {len(consumer_host)} entries for {C} consumers")
  host_of, prefer = _host_prefs(C, unit_host, consumer_host)

  sizes = {len(grp.metas) for grp in mini_batch.groups}
  whole_groups = len(sizes) == 1 and per_consumer % sizes.pop() == 0
  units = ([tuple(grp.metas) for grp in mini_batch.groups] if whole_groups
           else [(m,) for m in metas])
  items = [(sum(m.length for m in u), u) for u in units]
  per_item = len(units[0])

  contents, loads, plain_loads, used = _assign(items, C, per_consumer // per_item, prefer,
                                               tolerance)

  consumers, local_rows = [], 0
  n_micro = per_consumer // micro_batch_size
  for c, chunk in enumerate(contents):
    rows = [m for _, u in chunk for m in u]
    if host_of is not None and consumer_host is not None:
      local_rows += sum(host_of(m.unit) == consumer_host[c] for m in rows)
    if whole_groups and micro_batch_size % per_item == 0:
      # Whole groups per micro-batch too: a micro-batch then needs only its groups'
      # images (what the on-demand reader fetches first) and advantages stay local.
      micro, _ = _spread(chunk, n_micro, micro_batch_size // per_item)
      consumers.append(tuple(tuple(m for _, u in mb for m in u) for mb in micro))
    else:
      micro, _ = _spread([(m.length, m) for m in rows], n_micro, micro_batch_size)
      consumers.append(tuple(tuple(m for _, m in mb) for mb in micro))
  return MicroBatchPlan(
      consumers=tuple(consumers), consumer_tokens=tuple(loads), imbalance=_imbalance(loads),
      lpt_imbalance=_imbalance(plain_loads),
      local_fraction=local_rows / B if host_of is not None and consumer_host is not None else 0.0,
      used_locality=used)


def _assign(items, C: int, capacity: int, prefer, tolerance: float):
  """Items to C consumers by LPT; with `prefer`, the locality plan when it is balanced
  enough. (contents, loads, plain LPT's loads, whether locality was used)."""
  plain, plain_loads = _spread(items, C, capacity)
  if prefer is not None:
    slack = tolerance * sum(it[0] for it in items) / C
    local, local_loads = _spread(items, C, capacity, prefer=prefer, slack=slack)
    if _imbalance(local_loads) <= max(tolerance, _imbalance(plain_loads)) + 1e-12:
      return local, local_loads, plain_loads, True
  return plain, plain_loads, plain_loads, False


def _host_prefs(C, unit_host, consumer_host):
  """(unit -> host, item -> consumers on its host), each None when hosts are unknown."""
  host_of = unit_host if callable(unit_host) else (
      (lambda u: unit_host[u]) if unit_host is not None else None)
  if host_of is None or consumer_host is None:
    return host_of, None

  def prefer(item):
    hosts = collections.Counter(host_of(m.unit) for m in item[1])
    host = hosts.most_common(1)[0][0]
    return {c for c in range(C) if consumer_host[c] == host}
  return host_of, prefer


def _plan_packed(mini_batch, metas, C, pack, unit_host, consumer_host, tolerance):
  """Trajectories to consumers by tokens (LPT, locality as above), then packed."""
  if consumer_host is not None and len(consumer_host) != C:
    raise ValueError(f"consumer_host has {len(consumer_host)} entries for {C} consumers")
  P = pack.prefix_tokens  # a row position per prefix token too (the toy VLM's image)
  long = [m for m in metas if m.length + P > pack.row_tokens]
  if long:
    m = long[0]
    prefix = f" + {P} image prefix" if P else ""
    raise TooLongError(f"trajectory {m.id} (group {m.group_id}) has {m.length} tokens "
                       f"({m.prompt_len} prompt + {m.response_len} response{prefix}), more than a "
                       f"packed row's {pack.row_tokens} (JobConfig.seq_len); {len(long)} of the "
                       "mini-batch's trajectories are that long")
  host_of, prefer = _host_prefs(C, unit_host, consumer_host)
  items = [(m.length + P, (m,)) for m in metas]
  contents, loads, plain_loads, used = _assign(items, C, len(items), prefer, tolerance)
  shares = [[u[0] for _, u in chunk] for chunk in contents]
  micro = pack_micro_batches([[m.length + P for m in share] for share in shares], pack)
  consumers = tuple(tuple(tuple(shares[c][i] for i, _ in mb.items[c]) for mb in micro)
                    for c in range(C))
  rows = tuple(tuple(tuple(r for _, r in mb.items[c]) for mb in micro) for c in range(C))
  local_rows = (sum(host_of(m.unit) == consumer_host[c] for c in range(C) for m in shares[c])
                if prefer is not None else 0)
  return MicroBatchPlan(
      consumers=consumers, consumer_tokens=tuple(loads), imbalance=_imbalance(loads),
      lpt_imbalance=_imbalance(plain_loads),
      local_fraction=local_rows / len(metas) if prefer is not None else 0.0, used_locality=used,
      rows=rows, micro_rows=tuple(mb.rows for mb in micro))
