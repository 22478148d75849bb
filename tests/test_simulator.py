"""The pipeline simulator: definitions, determinism and queueing sanity."""
import numpy as np
import pytest

from knittrans_jax.admission import TrainBatchSpec
from knittrans_jax.sim import SimConfig, simulate, summarize
from knittrans_jax.sim.metrics import staleness_bound
from knittrans_jax.sim.pipeline import SimulationStalled
from knittrans_jax.sim.sweep import runs_below_bound

SOURCES = {"math": {"median": 300, "sigma": 0.5, "max_tokens": 4096},
           "code": {"median": 900, "sigma": 1.0, "max_tokens": 8192},
           "chat": {"dist": "pareto", "scale": 200, "alpha": 1.5, "max_tokens": 4096}}


def config(**kw):
  spec = kw.pop("spec", None) or TrainBatchSpec(
      group_size=4, groups_per_batch=32, num_mini_batches=4,
      source_quota={"math": 12, "code": 12, "chat": 8})
  base = dict(spec=spec, sources=SOURCES, engines=4, slots_per_engine=16, time_per_token_s=0.02,
              trainer_fixed_s=1.0, trainer_per_token_s=1e-4, sync_latency_s=1.0, train_batches=6)
  base.update(kw)
  return SimConfig(**base)


def test_colocated_has_zero_architectural_staleness():
  r = simulate(config(), mode="colocated")
  assert r.trajectories == 6 * 32 * 4
  np.testing.assert_array_equal(r.arch, 0)
  assert (r.v_consume - r.v_gen == r.j).all()


@pytest.mark.parametrize("policy", ["train_batch", "fifo", "constraint_preserving"])
def test_no_group_trained_twice_and_runs_are_seeded(policy):
  cfg = config()
  a, b = simulate(cfg, policy, 64), simulate(cfg, policy, 64)
  for field in ("v_gen", "v_consume", "j", "group_id"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  assert a.sim_time_s == b.sim_time_s
  groups, counts = np.unique(a.group_id, return_counts=True)
  assert (counts == cfg.spec.group_size).all() and len(groups) == 6 * 32
  c = simulate(config(seed=1), policy, 64)
  assert c.sim_time_s != a.sim_time_s


def test_m1_instant_rollout_train_batch_equals_constraint_preserving():
  spec = TrainBatchSpec(group_size=4, groups_per_batch=16, num_mini_batches=1,
                        source_quota={"math": 8, "code": 8})
  fast = {s: dict(m, prefill_s=0.0) for s, m in SOURCES.items() if s != "chat"}
  cfg = config(spec=spec, sources=fast, time_per_token_s=0.0, sync_latency_s=0.0)
  tb, cp = simulate(cfg, "train_batch", 32), simulate(cfg, "constraint_preserving", 32)
  assert tb.mini_batch_counts == cp.mini_batch_counts
  np.testing.assert_array_equal(tb.group_id, cp.group_id)
  np.testing.assert_array_equal(tb.v_consume, cp.v_consume)
  assert tb.sim_time_s == cp.sim_time_s


@pytest.mark.parametrize("policy,window", [("constraint_preserving", 48), ("train_batch", 64),
                                           ("fifo", 24)])
def test_littles_law(policy, window):
  r = simulate(config(train_batches=10), policy, window)
  groups_per_s = r.groups_done / r.sim_time_s
  assert r.mean_in_system == pytest.approx(groups_per_s * r.mean_sojourn_s, rel=0.05)


def test_quota_violations_fifo_only():
  cfg = config()
  assert summarize(simulate(cfg, "constraint_preserving", 64), cfg.spec)["quota_violations"] == 0
  assert summarize(simulate(cfg, "train_batch", 64), cfg.spec)["quota_violations"] == 0
  assert summarize(simulate(cfg, "fifo", 64), cfg.spec)["quota_violations"] > 0


def test_staleness_bound_drops_and_replaces():
  spec = TrainBatchSpec(group_size=4, groups_per_batch=32, num_mini_batches=4,
                        source_quota={"math": 12, "code": 12, "chat": 8}, max_staleness=4)
  cfg = config(spec=spec)
  r = simulate(cfg, "train_batch", 96)
  s = summarize(r, spec)
  assert s["dropped"].get("stale", 0) > 0 and s["quota_violations"] == 0
  assert r.trajectories == 6 * 32 * 4  # replacements keep every train batch whole
  assert ((r.v_consume - r.v_gen) <= 4 + r.j.max()).all()


def test_errors():
  with pytest.raises(SimulationStalled, match="train_batch"):
    simulate(config(), "train_batch", 16)  # W < G: a train batch can never complete
  with pytest.raises(ValueError, match="mode"):
    simulate(config(), mode="hybrid")
  with pytest.raises(ValueError, match="without a length model"):
    config(sources={"math": SOURCES["math"]})


def test_weight_sync_options():
  cfg = config()
  step = simulate(cfg, "constraint_preserving", 64)
  per_batch = simulate(config(publish="train_batch"), "constraint_preserving", 64)
  # Publishing once per train batch: engines see versions only in steps of M.
  assert set(np.unique(per_batch.v_gen) % cfg.spec.num_mini_batches) == {0}
  assert len(set(np.unique(step.v_gen) % cfg.spec.num_mini_batches)) > 1
  slow_sync = simulate(config(sync_latency_s=30.0), "constraint_preserving", 64)
  assert (slow_sync.v_consume - slow_sync.v_gen).mean() > (step.v_consume - step.v_gen).mean()
  # Interrupts keep v_gen at the oldest version, and each one costs decode time.
  interrupted = simulate(config(interrupt_on_sync=True, interrupt_cost_s=2.0),
                         "constraint_preserving", 64)
  assert interrupted.trajectories == step.trajectories
  assert interrupted.slot_busy_s > step.slot_busy_s


def test_staleness_bound_hand_computed():
  # Every response the same length: d = prefill + 500 x 0.02 = 10.05 s, L = 1 s.
  fixed = {s: {"median": 500, "sigma": 0.0, "max_tokens": 4096, "prefill_s": 0.05}
           for s in ("math", "code", "chat")}
  cfg = config(sources=fixed)
  rho = 3.0 / (4 * 8)  # 3 traj/s over n g = 4 x 8 trajectories per step
  x = rho * (10.05 + 1.0)
  want = np.mean([max(x - j, 0) for j in range(4)])
  assert staleness_bound(cfg, 3.0) == pytest.approx(want, rel=1e-9)
  # Slower than a step per decode: only the j = 0 quarter keeps a positive part.
  assert staleness_bound(cfg, 0.1) == pytest.approx(0.1 / 32 * 11.05 / 4, rel=1e-9)
  with pytest.raises(ValueError, match="publish"):
    staleness_bound(config(publish="train_batch"), 3.0)


def test_staleness_bound_holds_and_grows_with_throughput():
  cfg = config(train_batches=8)
  bounds = [staleness_bound(cfg, x) for x in (0.5, 1.0, 2.0, 4.0)]
  assert bounds == sorted(bounds) and bounds[-1] > bounds[0] > 0
  points = []
  for seed in (0, 1):
    c = cfg.replace(seed=seed)
    for policy in ("train_batch", "fifo", "constraint_preserving"):
      for window in (8, 16, 24, 32, 48, 64, 128):
        if policy == "train_batch" and window < 32:
          continue
        for dispatch in ("shuffled", "quota_aware"):
          s = summarize(simulate(c, policy, window, dispatch=dispatch), c.spec)
          s["stalled"] = False
          points.append(s)
          assert s["arch_staleness_mean"] >= staleness_bound(c, s["throughput_traj_per_s"])
  assert runs_below_bound(points, cfg) == []
