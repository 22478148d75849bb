"""Dispatch policies (admission/dispatch.py): quota-exact blocks in any order."""
import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans_jax.admission import TrainBatchSpec
from knittrans_jax.admission.dispatch import QuotaAware, Shuffled, make_dispatch
from knittrans_jax.sim import SimConfig, simulate, summarize

SPEC = TrainBatchSpec(group_size=4, groups_per_batch=16, num_mini_batches=4,
                      source_quota={"a": 6, "b": 6, "c": 4})


def draw(d, k, times=None):
  out = []
  for i in range(k):
    s = d.next()
    out.append(s)
    if times:
      d.observe(s, times[s] * (1 + 0.01 * (i % 3)))
  return out


@settings(max_examples=40, deadline=None)
@given(quota=st.lists(st.integers(1, 6), min_size=2, max_size=4), seed=st.integers(0, 2**16),
       times=st.lists(st.floats(0.1, 100.0), min_size=4, max_size=4))
def test_every_block_keeps_the_quota_mix(quota, seed, times):
  names = [f"s{i}" for i in range(len(quota))]
  spec = TrainBatchSpec(group_size=2, groups_per_batch=sum(quota), num_mini_batches=1,
                        source_quota=dict(zip(names, quota)))
  d = QuotaAware(spec, names, np.random.default_rng(seed), min_samples=1)
  seq = draw(d, 5 * sum(quota), dict(zip(names, times)))
  for k in range(5):
    block = seq[k * sum(quota):(k + 1) * sum(quota)]
    assert collections.Counter(block) == dict(zip(names, quota))


def test_deterministic_for_a_seed_and_restorable():
  times = {"a": 10.0, "b": 80.0, "c": 20.0}
  one = draw(QuotaAware(SPEC, "abc", np.random.default_rng(3), min_samples=2), 64, times)
  two = draw(QuotaAware(SPEC, "abc", np.random.default_rng(3), min_samples=2), 64, times)
  assert one == two
  d = QuotaAware(SPEC, "abc", np.random.default_rng(3), min_samples=2)
  head = draw(d, 21, times)
  saved = d.state()
  again = QuotaAware(SPEC, "abc", np.random.default_rng(99), min_samples=2)
  again.restore(saved)
  assert head + draw(again, 43, times) == one


def test_alike_sources_dispatch_exactly_as_shuffled():
  times = {"a": 50.0, "b": 52.0, "c": 49.0}  # within the 10% tolerance
  qa = draw(QuotaAware(SPEC, "abc", np.random.default_rng(7), min_samples=1), 80, times)
  assert qa == draw(Shuffled(SPEC, "abc", np.random.default_rng(7)), 80)
  # Unknown sources (fewer than min_samples each, no prior) too.
  assert draw(QuotaAware(SPEC, "abc", np.random.default_rng(7)), 80) == qa


def test_slowest_source_starts_first():
  d = QuotaAware(SPEC, "abc", np.random.default_rng(0), prior_s={"a": 5, "b": 90, "c": 30})
  block = draw(d, 16)
  assert block == ["b"] * 6 + ["c"] * 4 + ["a"] * 6
  # Learned online: the observations overrule the prior once min_samples are seen.
  d = QuotaAware(SPEC, "abc", np.random.default_rng(0), prior_s={"a": 5, "b": 90, "c": 30},
                 min_samples=4)
  draw(d, 16, {"a": 200.0, "b": 1.0, "c": 30.0})
  assert d.estimate("a") > d.estimate("c") > d.estimate("b")
  assert draw(d, 16)[:6] == ["a"] * 6


def test_bad_arguments():
  with pytest.raises(ValueError, match="unknown dispatch policy 'lifo'"):
    make_dispatch("lifo", SPEC, "abc", np.random.default_rng(0))
  with pytest.raises(ValueError, match=r"prior_s names unknown sources \['z'\]"):
    QuotaAware(SPEC, "abc", np.random.default_rng(0), prior_s={"z": 1.0})


def sim_config(sources, **kw):
  spec = kw.pop("spec", None) or TrainBatchSpec(
      group_size=4, groups_per_batch=32, num_mini_batches=4,
      source_quota={"math": 12, "code": 12, "chat": 8})
  return SimConfig(spec=spec, sources=sources, engines=4, slots_per_engine=16,
                   time_per_token_s=0.02, trainer_fixed_s=1.0, trainer_per_token_s=1e-4,
                   sync_latency_s=1.0, train_batches=8, **kw)


TAILS = {"math": {"median": 300, "sigma": 0.5, "max_tokens": 4096},
         "code": {"median": 1500, "sigma": 1.0, "max_tokens": 8192},
         "chat": {"dist": "pareto", "scale": 200, "alpha": 1.5, "max_tokens": 4096}}


def test_simulated_quota_aware_keeps_window_quotas_and_staleness_bound():
  spec = TrainBatchSpec(group_size=4, groups_per_batch=32, num_mini_batches=4,
                        source_quota={"math": 12, "code": 12, "chat": 8}, max_staleness=6)
  cfg = sim_config(TAILS, spec=spec)
  for window in (16, 40):
    r = simulate(cfg, "constraint_preserving", window, dispatch="quota_aware")
    s = summarize(r, spec)
    assert r.max_in_window <= window and s["quota_violations"] == 0
    assert r.trajectories == 8 * 32 * 4
    assert ((r.v_consume - r.v_gen) <= 6 + r.j.max()).all()
    assert (r.arch_floor <= np.maximum(r.arch, 0)).all()  # the floor is a lower bound


def test_simulated_quota_aware_helps_tails_and_not_hurts_alike_sources():
  tails = sim_config(TAILS)
  shuffled = summarize(simulate(tails, "constraint_preserving", 40), tails.spec)
  aware = summarize(simulate(tails, "constraint_preserving", 40, dispatch="quota_aware"),
                    tails.spec)
  assert aware["throughput_traj_per_s"] > shuffled["throughput_traj_per_s"]
  alike = sim_config({s: {"median": 600, "sigma": 0.6, "max_tokens": 4096} for s in TAILS})
  a = summarize(simulate(alike, "constraint_preserving", 40), alike.spec)
  b = summarize(simulate(alike, "constraint_preserving", 40, dispatch="quota_aware"), alike.spec)
  assert b["arch_staleness_mean"] <= a["arch_staleness_mean"] * 1.02
