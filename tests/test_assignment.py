import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans_jax.dataplane import plan_micro_batches
from knittrans_jax.types import GroupInfo, MiniBatch, TrajMeta


def mini_batch(rng, groups, n, units):
  gs = []
  for gid in range(groups):
    unit = rng.choice(units)  # a rollout worker writes a whole group to its unit
    metas = tuple(TrajMeta(unit=unit, row=gid * n + i, token_start=0, prompt_len=16,
                           response_len=int(rng.lognormvariate(5, 0.8)) + 1, source="math",
                           group_id=gid, index_in_group=i, version_first=0, version_last=0,
                           reward=0.0) for i in range(n))
    gs.append(GroupInfo(gid, "math", sum(m.length for m in metas), 0, metas=metas))
  return MiniBatch(0, 0, tuple(gs), 0)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]),
       st.sampled_from([2, 4, 8]), st.integers(1, 6))
def test_every_row_exactly_once_and_balanced(seed, C, mbs, n, groups_per_consumer):
  rng = random.Random(seed)
  G = C * groups_per_consumer
  B = G * n
  if B % (C * mbs):
    return
  units = [f"u{k}" for k in range(4)]
  mb = mini_batch(rng, G, n, units)
  hosts = {u: f"h{k % 2}" for k, u in enumerate(units)}
  consumer_host = [f"h{c % 2}" for c in range(C)]
  plan = plan_micro_batches(mb, C, mbs, hosts, consumer_host, tolerance=0.1)
  rows = [m.id for cons in plan.consumers for micro in cons for m in micro]
  assert sorted(rows) == sorted(m.id for grp in mb.groups for m in grp.metas)
  assert all(len(micro) == mbs for cons in plan.consumers for micro in cons)
  assert all(len(cons) == B // C // mbs for cons in plan.consumers)
  assert plan.imbalance <= max(0.1, plan.lpt_imbalance) + 1e-9
  for c, cons in enumerate(plan.consumers):
    assert sum(m.length for micro in cons for m in micro) == plan.consumer_tokens[c]
  # Groups stay whole on one consumer (each consumer's share is a multiple of n),
  # and within one micro-batch when the micro-batch size is a multiple of n.
  owner, micro_owner = {}, {}
  for c, cons in enumerate(plan.consumers):
    for k, micro in enumerate(cons):
      for m in micro:
        assert owner.setdefault(m.group_id, c) == c
        if mbs % n == 0:
          assert micro_owner.setdefault(m.group_id, (c, k)) == (c, k)


def test_locality_preferred_within_tolerance():
  rng = random.Random(0)
  units = [f"u{k}" for k in range(8)]
  mb = mini_batch(rng, 64, 4, units)
  hosts = {u: f"h{k % 4}" for k, u in enumerate(units)}
  consumer_host = [f"h{c}" for c in range(4)]
  plan = plan_micro_batches(mb, 4, 8, hosts, consumer_host, tolerance=0.05)
  blind = plan_micro_batches(mb, 4, 8)
  assert plan.used_locality and plan.local_fraction > 0.6  # random would be ~0.25
  assert plan.imbalance <= 0.05 + 1e-9
  assert blind.local_fraction == 0.0 and not blind.used_locality
  strict = plan_micro_batches(mb, 4, 8, hosts, consumer_host, tolerance=0.0)
  assert strict.imbalance <= max(0.0, strict.lpt_imbalance) + 1e-9


def test_groups_split_when_sizes_do_not_allow():
  rng = random.Random(1)
  mb = mini_batch(rng, 3, 4, ["u"])  # 12 rows over 2 consumers: 6 each, not a multiple of 4
  plan = plan_micro_batches(mb, 2, 3)
  assert sorted(len(micro) for cons in plan.consumers for micro in cons) == [3, 3, 3, 3]


def test_assignment_errors():
  rng = random.Random(2)
  mb = mini_batch(rng, 4, 4, ["u"])
  with pytest.raises(ValueError, match="does not split into 3 consumers"):
    plan_micro_batches(mb, 3, 1)
  with pytest.raises(ValueError, match="consumer_host has 1 entries for 2"):
    plan_micro_batches(mb, 2, 2, {"u": "h"}, ["h"])
  with pytest.raises(ValueError, match="carry no trajectory metadata"):
    plan_micro_batches(MiniBatch(0, 0, (GroupInfo(1, "math", 10, 0),), 0), 1, 1)


def test_the_job_planner_passes_hosts_through_and_reports_locality():
  """StepPlanner (job/work.py) is what the job calls: with the consumers' hosts and
  the units' hosts it plans the same rows as plan_micro_batches with them, and
  reports the local fraction; without hosts it says it does not know (None)."""
  from knittrans_jax.job.work import StepPlanner
  rng = random.Random(1)
  units = [f"u{k}" for k in range(8)]
  mb = mini_batch(rng, 64, 4, units)
  hosts = {u: f"h{k % 4}" for k, u in enumerate(units)}
  consumer_host = tuple(f"h{c}" for c in range(4))
  work = StepPlanner(4, 32, consumer_host=consumer_host, unit_host=hosts.__getitem__)(mb)
  direct = plan_micro_batches(mb, 4, 8, hosts, consumer_host)
  assert work.consumers == direct.consumers and work.local_fraction == direct.local_fraction
  local = sum(hosts[m.unit] == consumer_host[c] for c, cons in enumerate(work.consumers)
              for micro in cons for m in micro) / 256
  assert work.local_fraction == local > 0.6
  blind = StepPlanner(4, 32)(mb)
  assert blind.local_fraction is None and blind.consumers == plan_micro_batches(mb, 4, 8).consumers
  off = StepPlanner(4, 32, consumer_host=consumer_host, unit_host=hosts.__getitem__,
                    locality_tolerance=0.0)(mb)
  assert off.local_fraction < work.local_fraction
