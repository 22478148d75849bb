"""Admission policies: when does a mini-batch of finished groups go to the trainer?

All three share one interface and one bookkeeping of supply (finished but not
admitted, and in flight); they differ only in `_next`:

  train_batch            nothing of train batch k until every one of its M
                         mini-batches can be formed from finished groups
  fifo                   any g finished groups, in finish order; ignores quotas
  constraint_preserving  a mini-batch as soon as one satisfies its own
                         constraints and leaves the rest of the train batch
                         feasible (feasibility.py), oldest versions first

The rules peers ship (AReaL, verl, NeMo-RL, prime-rl, tinker-cookbook) share the
interface in peers.py; registry.py names them all.

Pure Python over metadata; no JAX, no payloads.
"""
from __future__ import annotations

import bisect
import collections
import itertools
from typing import Iterable

from knittrans_jax.admission import feasibility as F
from knittrans_jax.admission.spec import InfeasibleSpecError, TrainBatchSpec
from knittrans_jax.types import GroupInfo, MiniBatch


class AdmissionPolicy:
  name = "base"
  # Peer rules (peers.py) may gate rollout starts (`may_start`), continue requests in
  # flight on new weights (verl's partial rollout) and sync weights less often than
  # every step (verl's trigger_parameter_sync_step); ours do none of these.
  interrupts_in_flight = False
  publish_every = 1  # optimizer steps between weight syncs to rollout (verl's trigger)

  def __init__(self, spec: TrainBatchSpec):
    self.spec = spec
    self.g = spec.mini_batch_groups
    self._seq = itertools.count()
    self._order: dict[int, tuple] = {}  # group_id -> (version, arrival): pool order
    self._pool: dict[str, list[GroupInfo]] = collections.defaultdict(list)
    self._inflight: collections.Counter = collections.Counter()
    self._seen: set[int] = set()
    self.dropped: list[tuple[GroupInfo, str]] = []  # every drop: (group, 'stale' | 'zero_signal')
    self._stale_untaken: list[tuple[GroupInfo, str]] = []  # dropped by admit, not yet taken
    self.train_batch, self.index = 0, 0  # (k, j) of the next mini-batch
    self._needed = self._fresh_needs()
    self._tokens_seen, self._groups_seen = 0, 0
    self._started, self._failed, self._emitted = 0, 0, 0  # groups: dispatched, failed, admitted
    # The trainer's version when each group (by id, where the caller names it) was
    # dispatched: the stamp NeMo-RL's samplers keep (peers.py); kept until it retires.
    self._version_seen = 0
    self._dispatched_at: dict[int, int] = {}

  # ---- supply bookkeeping -------------------------------------------------
  def _check_source(self, source: str):
    if self.spec.source_quota is not None and self.spec.quota(source) == 0:
      raise ValueError(f"source {source!r} has no quota in this spec "
                       f"(quotas: {self.spec.source_quota})")

  def dispatched(self, source: str, count: int = 1, group_id: int | None = None) -> None:
    """`count` groups of `source` were sent to rollout (one, `group_id`, if named)."""
    self._check_source(source)
    if count < 0:
      raise ValueError(f"dispatched count {count} < 0")
    if group_id is not None:
      if count != 1:
        raise ValueError(f"dispatched(group_id={group_id}) names one group, not count={count}")
      self._dispatched_at[group_id] = self._version_seen
    self._inflight[source] += count
    self._started += count

  def options(self) -> dict:
    """The policy's knobs as set (a peer rule's; ours have none): for run records."""
    return {}

  def may_start(self, version: int) -> bool:
    """Whether one more group may start rollout now (the trainer at `version`), beyond
    the caller's window. Ours never gate starts; AReaL's eta and verl's threshold do."""
    self._version_seen = version
    return self._gate(version)

  def _gate(self, version: int) -> bool:
    return True

  def failed(self, source: str, count: int = 1, group_id: int | None = None) -> None:
    """`count` dispatched groups of `source` will never finish (one, `group_id`, if named)."""
    if count < 0 or count > self._inflight[source]:
      raise ValueError(f"failed({source!r}, {count}) but only {self._inflight[source]} in flight")
    self._dispatched_at.pop(group_id, None)
    self._inflight[source] -= count
    self._failed += count

  def finished(self, group: GroupInfo) -> list[tuple[GroupInfo, str]]:
    """A dispatched group finished (all n responses). Returns what it dropped: the
    group itself with 'zero_signal' (DAPO's filter), else nothing."""
    self._check_source(group.source)
    if group.group_id in self._seen:
      raise ValueError(f"group {group.group_id} finished twice")
    if self._inflight[group.source] <= 0:
      raise ValueError(f"group {group.group_id} of source {group.source!r} finished but none "
                       "of that source was dispatched")
    budget = self.spec.mini_batch_token_budget
    if budget is not None and group.num_tokens > budget:
      self._inflight[group.source] -= 1  # it will never be admitted: not supply
      self._dispatched_at.pop(group.group_id, None)
      raise InfeasibleSpecError(
          f"group {group.group_id} has {group.num_tokens} tokens, over the per-mini-batch "
          f"token budget {budget}: no mini-batch can ever hold it")
    self._seen.add(group.group_id)
    self._inflight[group.source] -= 1
    self._tokens_seen += group.num_tokens
    self._groups_seen += 1
    if self.spec.drop_zero_signal and group.zero_signal:
      self._dispatched_at.pop(group.group_id, None)
      self.dropped.append((group, "zero_signal"))
      return [(group, "zero_signal")]
    key = (group.version, next(self._seq))
    self._order[group.group_id] = key
    bisect.insort(self._pool[group.source], group, key=lambda grp: self._order[grp.group_id])
    return []

  def take_dropped(self) -> list[tuple[GroupInfo, str]]:
    """The groups `admit` dropped as stale since the last call (each returned once)."""
    out, self._stale_untaken = self._stale_untaken, []
    return out

  def _drop_stale(self, version: int) -> None:
    eta = self.spec.max_staleness
    if eta is None:
      return
    for groups in self._pool.values():  # sorted oldest first: stale ones lead
      k = 0
      while k < len(groups) and version - groups[k].version > eta:
        self.dropped.append((groups[k], "stale"))
        self._stale_untaken.append((groups[k], "stale"))
        del self._order[groups[k].group_id]
        self._dispatched_at.pop(groups[k].group_id, None)
        k += 1
      del groups[:k]

  def _drop(self, grp: GroupInfo, why: str) -> None:
    """Drops a finished, unadmitted group (reported by `take_dropped`)."""
    self.dropped.append((grp, why))
    self._stale_untaken.append((grp, why))
    del self._order[grp.group_id]
    self._dispatched_at.pop(grp.group_id, None)
    self._pool[grp.source].remove(grp)

  def _take(self, chosen: Iterable[GroupInfo]) -> None:
    ids = collections.defaultdict(set)
    for grp in chosen:
      ids[grp.source].add(grp.group_id)
      del self._order[grp.group_id]
      self._dispatched_at.pop(grp.group_id, None)
    for s, gone in ids.items():
      self._pool[s] = [grp for grp in self._pool[s] if grp.group_id not in gone]

  def _fresh_needs(self) -> dict[str, int] | None:
    q = self.spec.source_quota
    return None if q is None else {s: n for s, n in q.items() if n > 0}

  def position(self) -> dict:
    """Where the policy is: for checkpoints (restore with `restore_position`)."""
    return {"train_batch": self.train_batch, "index": self.index, "needed": self.needed()}

  def restore_position(self, position: dict) -> None:
    """Continues train batch k at mini-batch j with its remaining needs (resume)."""
    self.train_batch, self.index = int(position["train_batch"]), int(position["index"])
    self._version_seen = self.train_batch * self.spec.num_mini_batches + self.index
    needed = position.get("needed")
    self._needed = None if needed is None or self._fresh_needs() is None else dict(needed)

  # ---- views --------------------------------------------------------------
  def pool_counts(self) -> dict[str, int]:
    return {s: len(v) for s, v in self._pool.items() if v}

  def in_flight(self) -> dict[str, int]:
    return {s: n for s, n in self._inflight.items() if n}

  def needed(self) -> dict[str, int] | None:
    """Groups per source the current train batch still needs (None: no quotas)."""
    return None if self._needed is None else dict(self._needed)

  def short_sources(self) -> list[str]:
    """Sources whose finished-plus-in-flight supply cannot meet the current need.

    Without quotas the need is source-agnostic; '*' then means any source.
    """
    if self._needed is None:
      slots = self.spec.num_mini_batches - self.index
      short = sorted(s for s in (self.spec.mini_batch_bounds or {})
                     if len(self._pool.get(s, ())) + self._inflight[s] < slots * self.spec.bounds(s)[0])
      supply = sum(self.pool_counts().values()) + sum(self._inflight.values())
      return short or (["*"] if supply < slots * self.g else [])
    return sorted(s for s, r in self._needed.items()
                  if r > len(self._pool.get(s, ())) + self._inflight[s])

  # ---- admission ----------------------------------------------------------
  def admit(self, current_version: int) -> MiniBatch | None:
    """The next mini-batch, or None if none may be admitted yet. Call until None."""
    self._version_seen = current_version
    self._drop_stale(current_version)
    chosen = self._next(current_version)
    if chosen is None:
      return None
    return self._emit(chosen, current_version)

  def _emit(self, chosen: list[GroupInfo], version: int) -> MiniBatch:
    self._take(chosen)
    if self._needed is not None:
      for grp in chosen:
        self._needed[grp.source] -= 1
    mb = MiniBatch(self.train_batch, self.index, tuple(chosen), version)
    self._emitted += len(chosen)
    self.index += 1
    if self.index == self.spec.num_mini_batches:
      self.train_batch, self.index = self.train_batch + 1, 0
      self._needed = self._fresh_needs()
    return mb

  def _next(self, version: int) -> list[GroupInfo] | None:
    raise NotImplementedError

  # Shared by constraint_preserving and train_batch: the best admissible set now.
  def _best_set(self, pool: dict[str, list[GroupInfo]], needed, slots_left: int):
    """Best admissible set from `pool` (finished groups) for the current train batch."""
    counts = {s: len(v) for s, v in pool.items()}
    if needed is not None:
      iv = F.count_intervals(needed, counts, slots_left, self.spec.bounds)
    else:
      # Later mini-batches' minimums are reserved from finished groups only: in-flight
      # ones may finish late, and counting on them could admit later than
      # train_batch (a property test found such a case).
      iv = F.free_intervals(counts, counts, slots_left, self.spec.bounds,
                            list(self.spec.mini_batch_bounds or ()))
    mean = self._tokens_seen / max(self._groups_seen, 1)
    # Oldest version first; among equals, groups near the mean size keep
    # mini-batches token-balanced; then arrival order.
    key = lambda grp: (grp.version, abs(grp.num_tokens - mean), self._order[grp.group_id][1])
    budget = self.spec.mini_batch_token_budget
    if budget is not None:  # the packer needs every group, in key order
      return F.choose_within_budget({s: sorted(pool.get(s, ()), key=key) for s in iv}, iv,
                                    self.g, budget, key)
    return F.choose({s: _best_by_key(pool.get(s, ()), b, key) for s, (_, b) in iv.items()},
                    iv, self.g, key)


def _best_by_key(groups: list[GroupInfo], b: int, key) -> list[GroupInfo]:
  """The b best of `groups` by `key`, given `groups` sorted by version (key's head).

  Only groups up to the b-th one's version can be among them, so only that prefix
  is sorted: a few dozen groups, not the whole pool.
  """
  if b <= 0:
    return []
  end = min(b, len(groups))
  last = groups[end - 1].version
  while end < len(groups) and groups[end].version == last:
    end += 1
  return sorted(groups[:end], key=key)[:b]


class ConstraintPreservingPolicy(AdmissionPolicy):
  name = "constraint_preserving"

  def _next(self, version):
    slots = self.spec.num_mini_batches - self.index
    return self._best_set(self._pool, self._needed, slots)


class TrainBatchPolicy(AdmissionPolicy):
  """Baseline: waits until the whole train batch can be formed, then releases it."""
  name = "train_batch"

  def __init__(self, spec):
    super().__init__(spec)
    self._queue: collections.deque[list[GroupInfo]] = collections.deque()

  def _next(self, version):
    if not self._queue:
      self._plan_whole_batch()
    return self._queue.popleft() if self._queue else None

  def _plan_whole_batch(self):
    # Cheap necessary condition first: enough finished groups of every source.
    slots = self.spec.num_mini_batches - self.index
    if sum(len(v) for v in self._pool.values()) < slots * self.g or (
        self._needed is not None
        and any(len(self._pool.get(s, ())) < r for s, r in self._needed.items())):
      return
    # Cut M mini-batches from a copy of the pool; commit only if all M exist.
    pool = {s: list(v) for s, v in self._pool.items()}
    needed = None if self._needed is None else dict(self._needed)
    planned = []
    for j in range(self.index, self.spec.num_mini_batches):
      chosen = self._best_set(pool, needed, self.spec.num_mini_batches - j)
      if chosen is None:
        return
      gone = {grp.group_id for grp in chosen}
      pool = {s: [grp for grp in v if grp.group_id not in gone] for s, v in pool.items()}
      if needed is not None:
        for grp in chosen:
          needed[grp.source] -= 1
      planned.append(chosen)
    self._queue.extend(planned)

  def _drop_stale(self, version):
    if not self._queue:  # a released train batch is trained as released
      super()._drop_stale(version)


class FifoPolicy(AdmissionPolicy):
  """Any g finished groups in finish order, as streaming group samplers do."""
  name = "fifo"

  def _next(self, version):
    everything = [grp for v in self._pool.values() for grp in v]
    if len(everything) < self.g:
      return None
    everything.sort(key=lambda grp: self._order[grp.group_id][1])
    return everything[:self.g]

  def _fresh_needs(self):
    return None  # quotas are ignored, so they are not tracked either
