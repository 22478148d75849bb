"""Dispatch policies: which prompt source starts next (admission decides which
finished groups train; dispatch decides when each needed group starts).

Every policy hands out the same quota-exact blocks of G prompt sources that the
data loader always did (each block is one train batch's quota mix); only the
order within a block differs. So the multiset of sources per block, and with it
every train batch's quota, is unchanged by construction.

  shuffled     today's data loader: each block in a seeded random order (baseline).
  quota_aware  longest expected group first: within the block, the source whose
               groups take longest to complete (the slowest of n responses) starts
               first, so the groups a train batch waits for longest are not the
               last to start. Completion times are learned online from finished
               groups (the mean of the last `memory` per source), with `prior_s`
               until `min_samples` are seen; no oracle access to lengths. Sources
               not clearly faster than the slowest (within `tolerance` or two
               standard errors) keep their shuffled order among themselves; when
               all look alike it is `shuffled`, exactly.
  ratio        prime-rl's sampler: each group's source drawn independently with
               probability quota / G (uniform without quotas), so the mix holds in
               expectation only; for the peer rule prime_rl (peers.py).

Interface (`DispatchStream`; pure Python over metadata; the simulator and the job's
controller):
  next() -> source           the next group's source
  observe(source, seconds)   a group of `source` took `seconds` to generate (the
                             controller: the sampler call, else dispatch to done)
  estimate(source)           the expected seconds of a group of `source`, or None
  state() / restore(state)   JSON-able, saved with the job's progress
"""
from __future__ import annotations

import collections
import math
from typing import Mapping, Protocol, Sequence

import gin
import numpy as np

DISPATCH_POLICIES = ("shuffled", "quota_aware", "ratio")


class DispatchStream(Protocol):
  name: str

  def next(self) -> str: ...
  def observe(self, source: str, seconds: float) -> None: ...
  def estimate(self, source: str) -> float | None: ...
  def state(self) -> dict: ...
  def restore(self, state: dict) -> None: ...


def quota_block(spec, sources: Sequence[str]) -> list[str]:
  """One train batch's sources: the quota mix, or uniform over `sources` without one."""
  if spec.source_quota is not None:
    return [s for s, q in spec.source_quota.items() for _ in range(q)]
  names = list(sources)
  return [names[i % len(names)] for i in range(spec.groups_per_batch)]


class Shuffled:
  """The data loader: each block of G prompts has exactly the quota mix, shuffled."""

  name = "shuffled"

  def __init__(self, spec, sources: Sequence[str], rng: np.random.Generator):
    self._block, self._rng, self._queue = quota_block(spec, sources), rng, []

  def _refill(self) -> None:
    if not self._queue:
      self._queue = [str(s) for s in self._rng.permutation(self._block)][::-1]

  def next(self) -> str:
    self._refill()
    return self._queue.pop()

  def observe(self, source: str, seconds: float) -> None:
    pass  # the shuffled order learns nothing

  def estimate(self, source: str) -> float | None:
    return None

  def state(self) -> dict:
    """JSON-able: the rest of the current block and the generator's state."""
    return {"queue": list(self._queue), "rng": self._rng.bit_generator.state}

  def restore(self, state: dict) -> None:
    self._queue = list(state["queue"])
    self._rng.bit_generator.state = state["rng"]


@gin.configurable
class QuotaAware(Shuffled):
  """Longest expected group completion first, within each quota-exact block."""

  name = "quota_aware"

  def __init__(self, spec, sources: Sequence[str], rng: np.random.Generator,
               prior_s: Mapping[str, float] | None = None, min_samples: int = 8,
               memory: int = 256, tolerance: float = 0.1):
    super().__init__(spec, sources, rng)
    if min_samples < 1 or memory < min_samples or tolerance < 0:
      raise ValueError(f"QuotaAware: min_samples {min_samples} >= 1, memory {memory} >= "
                       f"min_samples and tolerance {tolerance} >= 0 are required")
    unknown = set(prior_s or {}) - set(self._block)
    if unknown:
      raise ValueError(f"QuotaAware.prior_s names unknown sources {sorted(unknown)}")
    self.prior_s = dict(prior_s or {})
    self.min_samples, self.tolerance = min_samples, tolerance
    self._seen: dict[str, collections.deque] = {
        s: collections.deque(maxlen=memory) for s in sorted(set(self._block))}
    self._sum = {s: 0.0 for s in self._seen}
    self._left: collections.Counter | None = None  # sources left in the current block
    self._sq = {s: 0.0 for s in self._seen}

  def estimate(self, source: str) -> float | None:
    """Expected dispatch-to-done seconds of a group of `source` (None: unknown)."""
    seen = self._seen[source]
    if len(seen) >= self.min_samples:
      return self._sum[source] / len(seen)
    return self.prior_s.get(source)

  def _stderr(self, source: str) -> float:
    seen = self._seen[source]
    k = len(seen)
    if k < max(2, self.min_samples):
      return 0.0  # the prior: taken as given
    mean = self._sum[source] / k
    var = max(self._sq[source] / k - mean * mean, 0.0) * k / (k - 1)
    return math.sqrt(var / k)

  def observe(self, source: str, seconds: float) -> None:
    if source in self._seen and math.isfinite(seconds) and seconds >= 0:
      seen = self._seen[source]
      if len(seen) == seen.maxlen:  # running sums over the last `memory` (O(1) a call)
        old = seen[0]
        self._sum[source] -= old
        self._sq[source] -= old * old
      seen.append(float(seconds))
      self._sum[source] += seconds
      self._sq[source] += seconds * seconds

  def next(self) -> str:
    self._refill()
    q = self._queue
    if self._left is None or sum(self._left.values()) != len(q):  # a new block (or restored)
      self._left = collections.Counter(q)
    left = [s for s, c in self._left.items() if c]
    est = {s: self.estimate(s) for s in left}
    if len(left) < 2 or any(e is None for e in est.values()):
      return self._take(len(q) - 1)  # nothing known to order by: the shuffled order
    slowest = max(left, key=lambda s: (est[s], s))
    # Sources not clearly faster than the slowest (within `tolerance`, or within two
    # standard errors of the estimates) are alike: they keep their shuffled order.
    top, se = est[slowest], self._stderr(slowest)
    alike = {s for s in left if top <= est[s] * (1 + self.tolerance)
             or top - est[s] <= 2 * math.hypot(se, self._stderr(s))}
    if len(alike) == len(left):
      return self._take(len(q) - 1)
    # The latest position in the queue pops first: the last entry of an alike source.
    i = len(q) - 1
    while q[i] not in alike:
      i -= 1
    return self._take(i)

  def _take(self, i: int) -> str:
    source = self._queue.pop(i)
    self._left[source] -= 1
    return source

  def state(self) -> dict:
    return {**super().state(), "seen": {s: list(d) for s, d in self._seen.items()}}

  def restore(self, state: dict) -> None:
    super().restore(state)
    self._left = None
    for s, values in state.get("seen", {}).items():
      if s in self._seen:
        self._seen[s].clear()
        self._sum[s] = self._sq[s] = 0.0
        for v in values:
          self.observe(s, v)


class Ratio(Shuffled):
  """Sources drawn independently by their share of the quota block (prime-rl's
  `rng.choices(env_names, weights=ratios)`): quotas in expectation, not exactly."""

  name = "ratio"

  def next(self) -> str:
    return str(self._block[self._rng.integers(len(self._block))])


def make_dispatch(name: str, spec, sources: Sequence[str], rng: np.random.Generator,
                  **kwargs) -> DispatchStream:
  if name == "shuffled":
    return Shuffled(spec, sources, rng)
  if name == "quota_aware":
    return QuotaAware(spec, sources, rng, **kwargs)
  if name == "ratio":
    return Ratio(spec, sources, rng)
  raise ValueError(f"unknown dispatch policy {name!r}; choose one of {DISPATCH_POLICIES}")
