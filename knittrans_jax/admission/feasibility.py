"""Exact count feasibility for mini-batch admission, and the choice of groups.

Counts. A train batch has m mini-batches left and still needs r_s groups of each
source s (sum r_s = m*g). Every mini-batch takes exactly g groups, and between
lo_s and hi_s of source s. Admitting x_s groups of each source now leaves
c_s = r_s - x_s for m-1 identical mini-batches. That residual is feasible iff

    (m-1) lo_s <= c_s <= (m-1) hi_s  for every s           (*)

given sum_s lo_s <= g <= sum_s hi_s (checked by the spec). Proof sketch: write
each entry as lo_s + y; y has equal row sums R = g - sum lo, column sums
d_s = c_s - (m-1) lo_s and cell caps u_s = hi_s - lo_s. By the max-flow min-cut
condition for transportation problems a y exists iff for every set T of columns
sum_T d_s <= sum over rows min(R, sum_T u_s) = (m-1) min(R, U_T); (*) gives
sum_T d_s <= (m-1) U_T, and sum_T d_s <= sum d_s = (m-1) R. The tests confirm it
against brute-force enumeration of matrices.

So the admissible count vectors now are exactly those with sum x_s = g and
x_s in [a_s, b_s], where
    a_s = max(lo_s, r_s - (m-1) hi_s),  b_s = min(hi_s, r_s - (m-1) lo_s, pool_s)
and one exists iff a_s <= b_s for all s and sum a_s <= g <= sum b_s: a closed
form, O(sources).

Tokens. The per-mini-batch budget is exact for the mini-batch being admitted:
the cheapest admissible set (each source's a_s smallest groups, then the smallest
groups overall up to each b_s) has the least total tokens of any admissible set,
so if it is over budget no admissible set fits. This greedy is optimal because
the admissible sets are the bases of a (truncated, lower-bounded) partition
matroid restricted by count intervals. The check is sound: it says "fits" only
with a set in hand that fits. It does not look ahead at the token sizes of
groups that have not finished (they are unknown); see docs/admission.md.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from knittrans_jax.types import GroupInfo


def count_intervals(needed: Mapping[str, int], pool: Mapping[str, int], slots_left: int,
                    bounds: Callable[[str], tuple[int, int]]) -> dict[str, tuple[int, int]]:
  """[a_s, b_s] for the mini-batch admitted now, with quotas (see module doc)."""
  rest = slots_left - 1
  out = {}
  for s, r in needed.items():
    lo, hi = bounds(s)
    out[s] = (max(lo, r - rest * hi, 0), min(hi, r - rest * lo, pool.get(s, 0), r))
  return out


def free_intervals(pool: Mapping[str, int], supply: Mapping[str, int], slots_left: int,
                   bounds: Callable[[str], tuple[int, int]],
                   bounded: Sequence[str]) -> dict[str, tuple[int, int]]:
  """[a_s, b_s] without quotas: the bounds, and the later mini-batches' minimums.

  Each of the slots_left - 1 later mini-batches of the train batch needs lo_s groups
  of s, so at most supply_s - (slots_left - 1) lo_s may be taken now (the policies
  pass the finished-unadmitted groups as the supply).
  """
  rest = slots_left - 1
  out = {}
  for s in set(bounded) | set(pool):
    lo, hi = bounds(s)
    out[s] = (lo, min(hi, pool.get(s, 0), supply.get(s, 0) - rest * lo))
  return out


def counts_admissible(intervals: Mapping[str, tuple[int, int]], g: int) -> bool:
  return (all(a <= b for a, b in intervals.values())
          and sum(a for a, _ in intervals.values()) <= g <= sum(b for _, b in intervals.values()))


def choose(pool: Mapping[str, Sequence[GroupInfo]], intervals: Mapping[str, tuple[int, int]],
           g: int, key: Callable[[GroupInfo], tuple]) -> list[GroupInfo] | None:
  """Best admissible set by `key` (smallest first); None if no count vector exists.

  `pool[s]` must already be sorted by `key`. Takes each source's a_s best, then the
  best remaining groups overall while each source stays within b_s. Greedy on a
  partition matroid, so it minimises the sum of any per-group weight that `key`
  orders by (e.g. versions: oldest first; tokens: cheapest set).
  """
  if not counts_admissible(intervals, g):
    return None
  chosen = []
  taken = {}
  for s, (a, _) in intervals.items():
    chosen += pool[s][:a]
    taken[s] = a
  extra = [grp for s, (a, b) in intervals.items() for grp in pool[s][a:b]]
  extra.sort(key=key)
  for grp in extra:
    if len(chosen) == g:
      break
    s = grp.source
    if taken[s] < intervals[s][1]:
      chosen.append(grp)
      taken[s] += 1
  return chosen if len(chosen) == g else None


def _tokens(groups) -> int:
  return sum(grp.num_tokens for grp in groups)


def choose_within_budget(pool: Mapping[str, Sequence[GroupInfo]],
                         intervals: Mapping[str, tuple[int, int]], g: int, budget: int,
                         key: Callable[[GroupInfo], tuple]) -> list[GroupInfo] | None:
  """Best set by `key` whose tokens fit `budget`; None iff no admissible set fits.

  Keeps the invariant "a completion within budget exists": a group (in `key`
  order) is taken only if the cheapest completion after taking it still fits.
  """
  by_tokens = {s: sorted(pool[s], key=lambda grp: grp.num_tokens) for s in intervals}
  cheapest = choose(by_tokens, intervals, g, key=lambda grp: grp.num_tokens)
  if cheapest is None or _tokens(cheapest) > budget:
    return None
  chosen, taken, used = [], {s: 0 for s in intervals}, 0

  def completion(extra_ids):
    rest_iv = {s: (max(a - taken[s], 0), b - taken[s]) for s, (a, b) in intervals.items()}
    rest_pool = {s: [grp for grp in by_tokens[s] if grp.group_id not in extra_ids]
                 for s in intervals}
    return choose(rest_pool, rest_iv, g - len(chosen), key=lambda grp: grp.num_tokens)

  ids = set()
  candidates = sorted((grp for s in intervals for grp in pool[s]), key=key)
  for grp in candidates:
    if len(chosen) == g:
      break
    s = grp.source
    if taken[s] >= intervals[s][1]:
      continue
    chosen.append(grp)
    taken[s] += 1
    ids.add(grp.group_id)
    rest = completion(ids)
    if rest is None or used + grp.num_tokens + _tokens(rest) > budget:
      chosen.pop()
      taken[s] -= 1
      ids.discard(grp.group_id)
      continue
    used += grp.num_tokens
  if len(chosen) < g:
    chosen += completion(ids)
  return chosen
