"""The train-batch spec: batch-wide and per-mini-batch requirements, checked up front."""
from __future__ import annotations

import dataclasses
from typing import Mapping

import gin


class InfeasibleSpecError(ValueError):
  """No train batch could ever satisfy the spec (or a group can never be admitted)."""


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainBatchSpec:
  """G groups of n trajectories per train batch, cut into M mini-batches of g = G/M.

  source_quota: exact groups per source in every train batch (sums to G), or None.
    With quotas, a group of any other source is refused.
  mini_batch_bounds: per-mini-batch (min, max) groups of a source, or None.
  mini_batch_token_budget: most tokens in one mini-batch, or None.
  max_staleness: eta; a group whose version is more than eta behind the version
    at admission is dropped, never trained.
  drop_zero_signal: groups whose rewards all agree are dropped (DAPO-style); they
    count toward no quota.
  """
  group_size: int
  groups_per_batch: int
  num_mini_batches: int
  source_quota: Mapping[str, int] | None = None
  mini_batch_bounds: Mapping[str, tuple[int, int]] | None = None
  mini_batch_token_budget: int | None = None
  max_staleness: int | None = None
  drop_zero_signal: bool = False

  def __post_init__(self):
    def bad(msg):
      raise InfeasibleSpecError(f"TrainBatchSpec: {msg}")

    for name in ("group_size", "groups_per_batch", "num_mini_batches"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        bad(f"{name} = {v!r} must be a positive int")
    G, M, n = self.groups_per_batch, self.num_mini_batches, self.group_size
    if G % M:
      bad(f"groups_per_batch G = {G} is not divisible by num_mini_batches M = {M}")
    g = G // M
    quota = None
    if self.source_quota is not None:
      quota = dict(self.source_quota)
      if not quota:
        bad("source_quota is empty; use None for no quotas")
      for s, q in quota.items():
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
          bad(f"source_quota[{s!r}] = {q!r} must be an int >= 0")
      if sum(quota.values()) != G:
        bad(f"source_quota sums to {sum(quota.values())}, not groups_per_batch G = {G}")
      object.__setattr__(self, "source_quota", quota)
    bounds = {}
    for s, b in dict(self.mini_batch_bounds or {}).items():
      if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(
          isinstance(x, int) and not isinstance(x, bool) for x in b)):
        bad(f"mini_batch_bounds[{s!r}] = {b!r} must be a (min, max) pair of ints")
      lo, hi = b
      if not 0 <= lo <= hi:
        bad(f"mini_batch_bounds[{s!r}] = {tuple(b)} needs 0 <= min <= max")
      if lo > g:
        bad(f"mini_batch_bounds[{s!r}] min {lo} exceeds the mini-batch size g = G/M = {g}")
      if quota is not None:
        q = quota.get(s, 0)
        if M * lo > q:
          bad(f"mini_batch_bounds[{s!r}] min {lo} x M = {M} mini-batches needs {M * lo} groups "
              f"but source_quota[{s!r}] = {q}")
        if M * min(hi, g) < q:
          bad(f"source_quota[{s!r}] = {q} cannot fit: at most {min(hi, g)} per mini-batch "
              f"x M = {M} mini-batches = {M * min(hi, g)}")
      bounds[s] = (lo, hi)
    object.__setattr__(self, "mini_batch_bounds", bounds or None)
    if sum(lo for lo, _ in bounds.values()) > g:
      bad(f"mini_batch_bounds minimums sum to {sum(lo for lo, _ in bounds.values())} "
          f"> mini-batch size g = {g}")
    # With quotas, M*lo_s <= q_s <= M*hi_s for each s and sum lo <= g make a train
    # batch exist (feasibility.py: the residual check with m = M); sum q = M*g then
    # implies the quota sources' maxima cover g.
    budget = self.mini_batch_token_budget
    if budget is not None:
      if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        bad(f"mini_batch_token_budget = {budget!r} must be a positive int")
      if budget < g * n:
        bad(f"mini_batch_token_budget = {budget} cannot hold g = {g} groups of n = {n} "
            f"trajectories (at least {g * n} tokens)")
    eta = self.max_staleness
    if eta is not None and (isinstance(eta, bool) or not isinstance(eta, int) or eta < 0):
      bad(f"max_staleness = {eta!r} must be an int >= 0")

  @property
  def mini_batch_groups(self) -> int:
    """g = G / M."""
    return self.groups_per_batch // self.num_mini_batches

  def bounds(self, source: str) -> tuple[int, int]:
    """Per-mini-batch (min, max) groups of `source` (max capped at g)."""
    lo, hi = (self.mini_batch_bounds or {}).get(source, (0, self.mini_batch_groups))
    return lo, min(hi, self.mini_batch_groups)

  def quota(self, source: str) -> int | None:
    return None if self.source_quota is None else self.source_quota.get(source, 0)

  def quota_violations(self, per_train_batch: Mapping[int, Mapping[str, int]]) -> int:
    """Complete train batches (G groups trained) whose per-source counts are off quota."""
    if self.source_quota is None:
      return 0
    return sum(1 for counts in per_train_batch.values()
               if sum(counts.values()) == self.groups_per_batch
               and any(counts.get(s, 0) != q for s, q in self.source_quota.items()))
