"""Admission policies on random specs and finish orders (hypothesis) and crafted cases."""
import collections
import itertools
import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_admission_feasibility import brute_residual

from knittrans_jax.admission import GroupInfo, InfeasibleSpecError, TrainBatchSpec, make_policy


def run(policy, finishes, dispatch_all=True, version_of=lambda i: 0, check=None):
  """Feeds finished groups one at a time; admits until None after each.

  Returns [(event index, MiniBatch)]. `check(policy, result, pool)` sees every admit
  call, with the finished groups neither admitted nor dropped (tracked here, from what
  the policy returns, not read from it).
  """
  if dispatch_all:
    for s in {grp.source for grp in finishes}:
      policy.dispatched(s, sum(grp.source == s for grp in finishes))
  out, pool = [], {}
  for i, grp in enumerate(finishes):
    if not policy.finished(grp):
      pool[grp.group_id] = grp
    while True:
      mb = policy.admit(version_of(i))
      for gone, _ in policy.take_dropped():
        del pool[gone.group_id]
      for chosen in (mb.groups if mb else ()):
        del pool[chosen.group_id]
      if check:
        check(policy, mb, list(pool.values()))
      if mb is None:
        break
      out.append((i, mb))
  return out


@st.composite
def workloads(draw, budget=False):
  S = draw(st.integers(1, 3))
  sources = [f"s{i}" for i in range(S)]
  M = draw(st.integers(1, 4))
  g = draw(st.integers(1, 4))
  G = M * g
  cuts = sorted(draw(st.lists(st.integers(0, G), min_size=S - 1, max_size=S - 1)))
  quota = dict(zip(sources, [b - a for a, b in zip([0] + cuts, cuts + [G])]))
  bounds = {}
  for s in sources:
    if draw(st.booleans()):
      lo = draw(st.integers(0, min(g, quota[s] // M)))
      hi = draw(st.integers(max(lo, -(-quota[s] // M)), g))
      bounds[s] = (lo, hi)
  use_quota = draw(st.booleans())
  n = 2
  spec_kw = dict(group_size=n, groups_per_batch=G, num_mini_batches=M,
                 source_quota=quota if use_quota else None, mini_batch_bounds=bounds or None)
  if budget:
    spec_kw["mini_batch_token_budget"] = draw(st.integers(g * 10, g * 40))
  try:
    spec = TrainBatchSpec(**spec_kw)
  except InfeasibleSpecError:
    return None
  K = draw(st.integers(1, 3))
  extra = draw(st.integers(0, G))
  seed = draw(st.integers(0, 2**16))
  rng = random.Random(seed)
  live = [s for s in sources if quota[s] > 0]  # a quota-0 source is refused on dispatch
  if use_quota or draw(st.booleans()):
    srcs = [s for s in sources for _ in range(quota[s] * K)] + [rng.choice(live)
                                                                for _ in range(extra)]
  else:  # supply unrelated to any mix: bounds may not be met by what finishes
    srcs = [rng.choice(sources) for _ in range(K * G + extra)]
  rng.shuffle(srcs)
  top = spec_kw.get("mini_batch_token_budget", 10 * g) // g  # a group always fits
  groups = [GroupInfo(group_id=i, source=s, num_tokens=rng.randint(n, max(n, top)),
                      version=i // max(g, 1), rewards=(1.0, 0.0)) for i, s in enumerate(srcs)]
  return spec, groups, K


def check_batches(spec, admitted, groups):
  finish_index = {grp.group_id: i for i, grp in enumerate(groups)}
  seen = set()
  by_batch = {}
  for i, mb in admitted:
    for grp in mb.groups:
      assert grp.group_id not in seen, "admitted twice"
      seen.add(grp.group_id)
      assert finish_index[grp.group_id] <= i, "admitted before it finished"
    assert len(mb.groups) == spec.mini_batch_groups
    for s in {grp.source for grp in mb.groups} | set(spec.mini_batch_bounds or ()):
      lo, hi = spec.bounds(s)
      assert lo <= mb.count(s) <= hi, (s, mb.count(s), (lo, hi))
    if spec.mini_batch_token_budget is not None:
      assert mb.num_tokens <= spec.mini_batch_token_budget
    by_batch.setdefault(mb.train_batch, []).append(mb)
  order = [(mb.train_batch, mb.index) for _, mb in admitted]
  assert order == sorted(order) and order == [(k, j) for k in range(len(by_batch))
                                              for j in range(spec.num_mini_batches)][:len(order)]
  if spec.source_quota is not None:
    for k, mbs in by_batch.items():
      if len(mbs) == spec.num_mini_batches:
        for s, q in spec.source_quota.items():
          assert sum(mb.count(s) for mb in mbs) == q, f"quota of {s} broken in train batch {k}"
  return by_batch


@settings(max_examples=200, deadline=None)
@given(workloads())
def test_constraint_preserving_properties_and_never_later_than_train_batch(work):
  event(f"valid workload: {work is not None}")
  if work is None:
    return
  spec, groups, K = work
  cp = run(make_policy("constraint_preserving", spec), groups)
  tb = run(make_policy("train_batch", spec), groups)
  cp_batches = check_batches(spec, cp, groups)
  check_batches(spec, tb, groups)
  if spec.source_quota is not None:  # supply meets K train batches: all K complete
    assert sum(len(v) == spec.num_mini_batches for v in cp_batches.values()) >= K
  assert len(cp) >= len(tb)
  cp_when = {(mb.train_batch, mb.index): i for i, mb in cp}
  for i, mb in tb:
    assert cp_when[(mb.train_batch, mb.index)] <= i, "admitted later than train_batch"


@settings(max_examples=100, deadline=None)
@given(workloads(budget=True))
def test_token_budget_always_respected(work):
  event(f"valid workload: {work is not None}")
  if work is None:
    return
  spec, groups, _ = work
  for name in ("constraint_preserving", "train_batch"):
    check_batches(spec, run(make_policy(name, spec), groups), groups)


def admissible_sets(policy, pool):
  """Brute force: every admissible g-subset of the pool right now."""
  spec, g = policy.spec, policy.g
  needed = policy.needed()
  slots = spec.num_mini_batches - policy.index
  found = []
  for subset in itertools.combinations(pool, g):
    counts = {}
    for grp in subset:
      counts[grp.source] = counts.get(grp.source, 0) + 1
    if any(not spec.bounds(s)[0] <= counts.get(s, 0) <= spec.bounds(s)[1]
           for s in set(counts) | set(spec.mini_batch_bounds or ())):
      continue
    if spec.mini_batch_token_budget and sum(grp.num_tokens for grp in subset) > spec.mini_batch_token_budget:
      continue
    if needed is None:  # the later mini-batches' minimums stay available
      pool = {}
      for grp in pool:
        pool[grp.source] = pool.get(grp.source, 0) + 1
      if any(pool.get(s, 0) - counts.get(s, 0) < (slots - 1) * spec.bounds(s)[0]
             for s in spec.mini_batch_bounds or ()):
        continue
    if needed is not None:
      if any(counts.get(s, 0) > needed.get(s, 0) for s in counts):
        continue
      residual = {s: needed[s] - counts.get(s, 0) for s in needed}
      bounds = {s: spec.bounds(s) for s in residual}
      if not brute_residual(residual, slots - 1, g, bounds):
        continue
    found.append(subset)
  return found


@settings(max_examples=200, deadline=None)
@given(workloads(budget=True))
def test_eager_admits_whenever_brute_force_finds_a_set(work):
  event(f"valid workload: {work is not None}")
  if work is None:
    return
  spec, groups, _ = work
  small = len(groups) <= 14 and spec.mini_batch_groups <= 3
  event(f"small enough for brute force: {small}")
  if not small:
    return

  def check(policy, mb, pool):
    assert sorted(policy.pool_counts().items()) == sorted(
        collections.Counter(grp.source for grp in pool).items())
    if mb is None:
      assert admissible_sets(policy, pool) == [], "returned None while an admissible set existed"

  run(make_policy("constraint_preserving", spec), groups, check=check)


def test_fifo_breaks_a_quota_that_constraint_preserving_keeps():
  spec = TrainBatchSpec(group_size=4, groups_per_batch=8, num_mini_batches=2,
                        source_quota={"math": 4, "code": 4})
  # Math finishes first (short answers); code is long-tailed.
  finishes = [GroupInfo(i, "math", 100, 0) for i in range(8)] + [
      GroupInfo(8 + i, "code", 900, 0) for i in range(8)]
  fifo = run(make_policy("fifo", spec), finishes)
  first = [mb for _, mb in fifo if mb.train_batch == 0]
  assert sum(mb.count("math") for mb in first) == 8  # quota says 4
  cp = run(make_policy("constraint_preserving", spec), finishes)
  check_batches(spec, cp, finishes)
  (i0, mb0), (i1, mb1) = cp[0], cp[1]
  assert mb0.count("math") == 4 and mb0.count("code") == 0 and i0 == 3  # early, and safe
  assert mb1.count("code") == 4


def test_staleness_bound_drops_old_groups_and_reports_short_sources():
  spec = TrainBatchSpec(group_size=2, groups_per_batch=4, num_mini_batches=2,
                        source_quota={"a": 2, "b": 2}, max_staleness=1)
  p = make_policy("constraint_preserving", spec)
  p.dispatched("a", 2)
  p.dispatched("b", 2)
  p.finished(GroupInfo(0, "a", 10, version=0))
  p.finished(GroupInfo(1, "a", 10, version=0))
  assert p.admit(current_version=5) is None  # both are 5 versions old: dropped
  assert [(grp.group_id, why) for grp, why in p.dropped] == [(0, "stale"), (1, "stale")]
  assert p.short_sources() == ["a"]
  p.dispatched("a", 2)
  assert p.short_sources() == []
  p.finished(GroupInfo(2, "a", 10, version=5))
  p.finished(GroupInfo(3, "b", 10, version=5))
  mb = p.admit(current_version=5)
  assert mb is not None and {grp.group_id for grp in mb.groups} == {2, 3}


def test_zero_signal_groups_are_dropped_and_count_toward_nothing():
  spec = TrainBatchSpec(group_size=2, groups_per_batch=2, num_mini_batches=1,
                        drop_zero_signal=True)
  p = make_policy("constraint_preserving", spec)
  p.dispatched("x", 3)
  p.finished(GroupInfo(0, "x", 10, 0, rewards=(1.0, 1.0)))
  p.finished(GroupInfo(1, "x", 10, 0, rewards=(0.0, 1.0)))
  assert p.admit(0) is None and p.dropped[0][1] == "zero_signal"
  p.finished(GroupInfo(2, "x", 10, 0, rewards=(0.5, 0.0)))
  assert {grp.group_id for grp in p.admit(0).groups} == {1, 2}


def test_bad_events_are_refused():
  spec = TrainBatchSpec(group_size=2, groups_per_batch=2, num_mini_batches=1,
                        source_quota={"a": 2}, mini_batch_token_budget=100)
  p = make_policy("constraint_preserving", spec)
  with pytest.raises(ValueError, match="'zzz' has no quota"):
    p.dispatched("zzz")
  with pytest.raises(ValueError, match="none of that source was dispatched"):
    p.finished(GroupInfo(0, "a", 10, 0))
  p.dispatched("a", 3)
  with pytest.raises(InfeasibleSpecError, match="group 5 has 101 tokens"):
    p.finished(GroupInfo(5, "a", 101, 0))
  p.finished(GroupInfo(1, "a", 10, 0))
  with pytest.raises(ValueError, match="finished twice"):
    p.finished(GroupInfo(1, "a", 10, 0))
  with pytest.raises(ValueError, match="unknown admission policy"):
    make_policy("lifo", spec)
