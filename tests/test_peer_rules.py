"""The peers' admission rules (admission/peers.py) on hand-worked schedules, what each
gives up (admission/costs.py), and the rules in the simulator and the controller."""
import collections
import json

import gin
import numpy as np
import pytest
from hypothesis import given, settings
from test_admission_policies import run, workloads
from test_controller import FakePool
from test_simulator import config as sim_config

from knittrans_jax.admission import PEER_NAMES, GroupInfo, TrainBatchSpec, make_policy
from knittrans_jax.admission.costs import quota_error, tail_bias
from knittrans_jax.admission.dispatch import Shuffled, make_dispatch
from knittrans_jax.job.controller import Controller
from knittrans_jax.job.progress import ControllerState
from knittrans_jax.sim import peers as sim_peers
from knittrans_jax.sim import simulate, summarize

SPEC = TrainBatchSpec(group_size=2, groups_per_batch=4, num_mini_batches=2,
                      source_quota={"a": 2, "b": 2})


def grp(gid, source="a", version=0):
  return GroupInfo(gid, source, 4, version, (0.0, 1.0))


def start(policy, version, gids, source="a"):
  """Dispatches `gids` while the rule lets them start; returns those it let start."""
  sent = []
  for gid in gids:
    if not policy.may_start(version):
      break
    policy.dispatched(source, group_id=gid)
    sent.append(gid)
  return sent


def ids(mb):
  return [g.group_id for g in mb.groups]


# ---- each rule on a hand-worked schedule ----------------------------------------------
def test_areal_gates_at_eta_and_takes_the_oldest_started():
  p = make_policy("areal", SPEC, max_head_offpolicyness=0)
  assert start(p, 0, range(5)) == [0, 1]  # (eta + v + 1) g = 2 groups accepted or running
  p.finished(grp(1))
  assert p.admit(0) is None  # g = 2 groups needed
  p.finished(grp(0))
  assert ids(p.admit(0)) == [0, 1]
  assert start(p, 0, [2]) == []  # consumed groups still count (AReaL's `accepted`)
  assert start(p, 1, [2, 3, 4]) == [2, 3]  # v = 1: up to 4 ever accepted
  q = make_policy("areal", SPEC, max_head_offpolicyness=1)
  assert start(q, 0, range(9)) == [0, 1, 2, 3]
  for gid in (3, 2, 1):  # finish order 3, 2, 1: AReaL sorts by start, not finish
    q.finished(grp(gid))
  assert ids(q.admit(0)) == [1, 2]
  q.failed("a", group_id=0)  # a rejected rollout frees its place
  assert start(q, 1, [4, 5, 6, 7]) == [4, 5, 6]


def test_verl_counter_resets_at_each_sync_and_takes_finish_order():
  p = make_policy("verl", SPEC, staleness_threshold=0.5, trigger_parameter_sync_step=1,
                  require_batches=1, partial_rollout=True)
  assert p.max_required == 3 and p.interrupts_in_flight  # int(2 * 1 * 1.5 * 1)
  assert start(p, 0, range(9)) == [0, 1, 2]
  for gid in (2, 0):
    p.finished(grp(gid))
  assert ids(p.admit(0)) == [2, 0]  # first finished, first trained
  assert start(p, 0, [3]) == []  # no sync yet: the counter is still 3
  assert start(p, 1, [3, 4, 5]) == [3, 4]  # sync: counter = 1 in flight, 2 more may start
  r = make_policy("verl", SPEC, staleness_threshold=0.0, trigger_parameter_sync_step=2,
                  require_batches=2, partial_rollout=False)
  assert r.max_required == 8 and not r.interrupts_in_flight
  assert start(r, 0, range(9)) == list(range(8))
  for gid in (5, 1, 7, 0):
    r.finished(grp(gid))
  assert [ids(r.admit(0)), ids(r.admit(0))] == [[5, 1], [7, 0]]  # a local step of 2
  assert start(r, 2, [8]) == []  # a sync happens every 2 x 2 steps
  assert start(r, 4, [8, 9]) == [8, 9]  # synced: 4 in flight, counter 4 < 8


def test_nemo_weight_fifo_waits_for_the_oldest_weight_in_flight_and_evicts():
  p = make_policy("nemo_weight_fifo", SPEC, max_staleness_versions=1)
  assert start(p, 0, range(9)) == [0, 1, 2, 3]  # gate window 1: (1 + 0 + 1) x g
  q = make_policy("nemo_weight_fifo", SPEC, max_staleness_versions=1)
  start(q, 0, [0, 1])  # stamped with version 0
  start(q, 1, [2, 3, 4, 5])  # stamped with version 1
  for gid in (2, 3, 1):
    q.finished(grp(gid, version=1 if gid > 1 else 0))
  assert q.admit(1) is None  # weight 0: one ready, group 0 still in flight: it waits
  q.finished(grp(0))
  assert ids(q.admit(1)) == [0, 1]  # weight 0's groups, then
  assert ids(q.admit(1)) == [2, 3]  # weight 1's, in dispatch order
  for gid in (5, 4):
    q.finished(grp(gid, version=1))
  assert q.admit(3) is None  # min_valid = 2: weight 1's ready groups are evicted
  assert sorted(g.group_id for g, why in q.take_dropped() if why == "stale") == [4, 5]
  # (1 + 3 + 1) x 2 = 10 ever dispatched: the 2 evicted groups' places are not given back
  assert start(q, 3, range(6, 13)) == [6, 7, 8, 9]


def test_nemo_windowed_has_no_gate_evicts_and_can_take_freshest_first():
  p = make_policy("nemo_windowed", SPEC, max_staleness_versions=1)
  assert start(p, 0, range(6)) == list(range(6))
  start(p, 2, [6, 7])
  for gid in (0, 1, 6, 7, 2):
    p.finished(grp(gid))
  assert ids(p.admit(2)) == [6, 7]  # 0, 1, 2 stamped 0 < 2 - 1: evicted
  assert sorted(g.group_id for g, _ in p.take_dropped()) == [0, 1, 2]
  q = make_policy("nemo_windowed", SPEC, max_staleness_versions=3, sample_freshest_first=True)
  start(q, 0, [0, 1])
  start(q, 1, [2, 3])
  for gid in range(4):
    q.finished(grp(gid))
  assert ids(q.admit(1)) == [2, 3]


def test_prime_rl_has_no_gate_and_drops_more_than_max_off_policy_behind():
  p = make_policy("prime_rl", SPEC, max_off_policy_steps=1)
  assert start(p, 0, range(6)) == list(range(6))  # only the window bounds what is in flight
  p.finished(grp(1))
  p.finished(grp(0))
  assert ids(p.admit(0)) == [1, 0]  # finish order
  p.admit(1)  # the trainer is at version 1: one step off policy is kept
  assert p.finished(grp(2)) == [] and p.finished(grp(3)) == []
  assert ids(p.admit(1)) == [2, 3]
  p.admit(2)  # two steps: cancelled (dropped as it finishes)
  assert [g.group_id for g, why in p.finished(grp(4))] == [4]
  assert p.take_dropped() == []  # reported once, by finished()
  assert p.options() == {"max_off_policy_steps": 1}


def test_tinker_discard_drops_beyond_its_bound_in_finish_order():
  p = make_policy("tinker_discard", SPEC, max_steps_off_policy=1)
  start(p, 0, range(4))
  for gid, v in ((3, 0), (1, 1), (0, 1), (2, 1)):
    p.finished(grp(gid, version=v))
  mb = p.admit(2)
  assert ids(mb) == [1, 0] and [g.group_id for g, _ in p.take_dropped()] == [3]


@pytest.mark.parametrize("name,field,value", [
    ("areal", "max_head_offpolicyness", -1), ("verl", "staleness_threshold", -0.5),
    ("verl", "trigger_parameter_sync_step", 0), ("verl", "partial_rollout", "yes"),
    ("nemo_weight_fifo", "max_staleness_versions", 1.5), ("prime_rl", "max_off_policy_steps", -1),
    ("tinker_discard", "max_steps_off_policy", True)])
def test_bad_knobs_are_named(name, field, value):
  with pytest.raises(ValueError, match=f"{field} = {value!r}"):
    make_policy(name, SPEC, **{field: value})


def test_unknown_policy_and_options_for_ours_are_refused():
  with pytest.raises(ValueError, match="unknown admission policy 'areall'"):
    make_policy("areall", SPEC)
  with pytest.raises(ValueError, match="takes no options"):
    make_policy("fifo", SPEC, max_head_offpolicyness=1)


def test_knobs_from_gin():
  gin.parse_config("ArealPolicy.max_head_offpolicyness = 5")
  try:
    assert make_policy("areal", SPEC).options() == {"max_head_offpolicyness": 5}
  finally:
    gin.clear_config()


# ---- what each rule gives up ----------------------------------------------------------
def test_quota_error_hand_computed():
  mbs = [(0, 0, {"a": 2}), (0, 1, {"a": 1, "b": 1}), (1, 0, {"b": 2})]
  q = quota_error(mbs, SPEC)
  # train batch 0: a 3 of 2, b 1 of 2 -> (1 + 1) / 4; train batch 1 is not complete
  assert q["mean"] == q["max"] == 0.5 and q["train_batches"] == 1
  assert q["worst_source"]["max"] == 0.25 and q["worst_source"]["by_source"] == {"a": 1}
  # mini-batches: |1 - .5| + |0 - .5| = 1, 0, 1
  assert q["mini_batch"]["mean"] == pytest.approx(2 / 3) and q["mini_batch"]["max"] == 1.0
  spec = TrainBatchSpec(group_size=2, groups_per_batch=4, num_mini_batches=2)
  assert quota_error(mbs, spec) is None


def test_tail_bias_hand_computed():
  groups = [("a" if t % 2 else "b", float(t), "trained" if t <= 8 else "stale")
            for t in range(1, 11)] + [("a", None, "pending"), ("b", 3.0, "pending")]
  b = tail_bias(groups)
  assert b["dispatched"] == 12 and b["decided"] == 10 and b["trained_share"] == 0.8
  assert [d["trained_share"] for d in b["by_decile"]] == [1.0] * 8 + [0.0, 0.0]
  assert b["gen_s_ratio"] == pytest.approx(4.5 / 5.5)
  assert b["by_source"] == {"a": 0.8, "b": 0.8}  # 9 of a, 10 of b dropped


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_constraint_preserving_has_zero_quota_error_by_construction(work):
  if work is None:
    return
  spec, groups, _ = work
  admitted = run(make_policy("constraint_preserving", spec), groups)
  q = quota_error([(mb.train_batch, mb.index, collections.Counter(g.source for g in mb.groups))
                   for _, mb in admitted], spec)
  assert q is None or q["max"] in (None, 0.0)


# ---- in the simulator and the controller ----------------------------------------------
@pytest.mark.parametrize("name", PEER_NAMES)
def test_each_rule_runs_in_the_simulator(name):
  cfg = sim_config()
  rule = sim_peers.RULES[name]
  knob = rule.values([4], cfg)[-1]
  r = simulate(cfg, name, rule.window(knob, cfg), dispatch=rule.dispatch,
               options=rule.options(knob))
  assert len(set(r.group_id)) * cfg.spec.group_size == r.trajectories  # none trained twice
  assert np.all(r.v_consume >= r.v_gen)
  s = summarize(r, cfg.spec)
  trained = sum(f == "trained" for f in r.group_fate)
  assert trained * cfg.spec.group_size == r.trajectories
  assert s["options"] == make_policy(name, cfg.spec, **rule.options(knob)).options()


def test_dropping_rules_show_tail_bias_and_constraint_preserving_none():
  cfg = sim_config(train_batches=8)
  g = cfg.spec.mini_batch_groups
  cp = summarize(simulate(cfg, "constraint_preserving", 4 * g), cfg.spec)
  assert cp["quota_error"]["max"] == 0.0 and cp["tail_bias"]["trained_share"] == 1.0
  tk = summarize(simulate(cfg, "tinker_discard", 4 * g, options={"max_steps_off_policy": 1}),
                 cfg.spec)
  deciles = [d["trained_share"] for d in tk["tail_bias"]["by_decile"]]
  assert tk["dropped"]["stale"] > 0 and tk["tail_bias"]["gen_s_ratio"] < 1
  assert deciles[-1] < deciles[0]  # the slowest problems are the ones discarded
  assert tk["quota_error"]["mean"] > 0


def test_peer_sweep_reports_matched_reductions_or_why_not():
  cfg = sim_config(train_batches=4)
  jobs = [j for j in sim_peers.points_for(cfg, ["areal", "tinker_discard"], up_to=1)]
  out = sim_peers.summarize_rules(sim_peers.run(jobs, workers=1), ["areal", "tinker_discard"])
  assert set(out) == {"areal", "tinker_discard", *sim_peers.OURS}
  for name in ("areal", "tinker_discard"):
    for f in out[name]["frontier"]:
      m = f["matched_reduction"]
      for x in m["by_seed"].values():  # a reduction recomputed from its own numbers
        if x["reduction"] is not None:
          assert x["reduction"] == pytest.approx(1 - x["arch_staleness_mean"]
                                                 / f["arch_staleness_mean"])
        else:
          assert x["reason"]
  assert out["constraint_preserving"]["quota_error"]["max"] == 0.0


def test_controller_asks_the_rule_before_each_start():
  spec = TrainBatchSpec(group_size=2, groups_per_batch=6, num_mini_batches=3,
                        source_quota={"a": 2, "b": 2, "c": 2})
  policy = make_policy("areal", spec, max_head_offpolicyness=0)
  pool = FakePool()
  ctl = Controller(spec, policy, Shuffled(spec, ("a", "b", "c"), np.random.default_rng(0)),
                   pool, ControllerState(), window=12)
  assert ctl.dispatch(version=0) == 2  # the gate, not the window of 12
  assert ctl.dispatch(version=0) == 0
  ctl.poll()
  mb = ctl.admit(0)
  ctl.trained(mb)
  assert ctl.dispatch(version=1) == 2
  assert ctl.tail_bias()["fates"] == {"trained": 2}


def test_ratio_dispatch_keeps_the_mix_in_expectation_only():
  spec = TrainBatchSpec(group_size=2, groups_per_batch=4, num_mini_batches=2,
                        source_quota={"a": 3, "b": 1})
  d = make_dispatch("ratio", spec, ("a", "b"), np.random.default_rng(0))
  blocks = [collections.Counter(d.next() for _ in range(4)) for _ in range(500)]
  share = sum(b["a"] for b in blocks) / 2000
  assert abs(share - 0.75) < 0.03  # the ratio holds on average
  assert sum(b["a"] != 3 for b in blocks) > 100  # but not in each block


def test_verl_syncs_weights_every_trigger_steps():
  cfg = sim_config()
  g = cfg.spec.mini_batch_groups
  for partial in (False, True):
    r = simulate(cfg, "verl", 8 * g, options={"trigger_parameter_sync_step": 2,
                                              "staleness_threshold": 1.0,
                                              "partial_rollout": partial})
    assert set(np.unique(r.v_gen) % 2) == {0}  # rollout only ever saw synced versions
    assert r.v_consume.max() > 2


def test_real_peers_configurations_and_report(tmp_path, monkeypatch):
  """scripts/real_peers.py's pure parts: each rule's runs at the windows sim/peers.py
  gives them, its knobs as gin bindings, and the report over (synthetic) runs."""
  monkeypatch.syspath_prepend("scripts")
  import real_peers
  confs = real_peers.configurations(["areal", "tinker_discard", "prime_rl"], [4, 8, 16],
                                    ["quota_aware"], g=4)
  by = {(c["rule"], str(c["options"])): c for c in confs}
  assert [c["window"] for c in confs if c["rule"].startswith("constraint")] == [4, 8, 16]
  assert by[("areal", "{'max_head_offpolicyness': 3}")]["window"] == 16  # gated: the largest
  assert by[("tinker_discard", "{'max_steps_off_policy': 3}")]["window"] == 16  # (3 + 1) g
  assert sorted(c["window"] for c in confs if c["rule"] == "prime_rl") == [8, 16, 32]
  areal = by[("areal", "{'max_head_offpolicyness': 7}")]
  assert "ArealPolicy.max_head_offpolicyness = 7" in real_peers.bindings(areal, 0, 20)

  def run(rule, window, options, seed, thr, a):
    return {"rule": rule, "window": window, "options": options, "seed": seed,
            "throughput_traj_per_s": thr, "arch_staleness_mean": a, "arch_staleness_p99": a,
            "quota_error": {"mean": 0.0 if rule.startswith("c") else 0.2, "max": 0.3,
                            "worst_source": {"max": 0.1}, "mini_batch": {"mean": 0.5}},
            "tail_bias": tail_bias([("a", 1.0, "trained"), ("a", 2.0, "stale")]),
            "dropped": {}, "stalled": None, "sim": {"arch_staleness_mean": a,
                                                    "traj_per_s": thr * 1.1}}
  runs = [run("constraint_preserving+quota_aware", w, {}, s, thr, a)
          for s in (0, 1) for w, thr, a in ((4, 10.0, 0.5), (8, 20.0, 1.0))]
  runs += [run("areal", 16, {"max_head_offpolicyness": 1}, s, 15.0, 2.0) for s in (0, 1)]
  out = {"runs": runs, "seeds": [0, 1], "train_batches": 2, "gin_file": "x", "G": 16, "g": 4,
         "wall_s": 1.0}
  real_peers.report(out, ["areal"], str(tmp_path / "r.json"))
  r = json.loads((tmp_path / "r.json").read_text())["summary"]
  m = r["rules"]["areal"]["frontier"][0]["matched_reduction"]
  assert m["mean"] == pytest.approx(0.5)  # ours at W = 8 (20/s >= 15/s): 1 - 1.0 / 2.0
  assert r["sim_relative_error"]["throughput_traj_per_s"]["mean"] == pytest.approx(0.1)


def test_a_resumed_gate_counts_what_was_trained():
  p = make_policy("areal", SPEC, max_head_offpolicyness=0)
  p.restore_position({"train_batch": 1, "index": 0, "needed": None})  # version 2
  assert start(p, 2, range(9)) == [0, 1]  # as a run that never stopped: (0 + 2 + 1) x 2 - 4
  q = make_policy("nemo_weight_fifo", SPEC, max_staleness_versions=1)
  q.restore_position({"train_batch": 1, "index": 1, "needed": None})  # version 3
  assert start(q, 3, range(9)) == [0, 1, 2, 3]
