"""Issue 45's pure parts: the simulator's trace mode (sim/trace.py) replays recorded
times exactly, and the matched-throughput reading of real runs (study/matched.py)
picks the smallest matching window, pairs reductions by seed and names what it
cannot match. No job runs here (scripts/real_staleness.py does; its flags are
checked in tests/test_docs_commands.py)."""
import json

import numpy as np
import pytest

from knittrans_jax.sim import simulate
from knittrans_jax.sim.trace import Trace, TraceError, predict, steady_state
from knittrans_jax.study import matched


def write_trace(path, **over):
  raw = {"spec": {"group_size": 2, "groups_per_batch": 4, "num_mini_batches": 2,
                  "source_quota": {"a": 2, "b": 2}},
         "workers": 1, "groups_per_call": 1, "engine": "jax", "suite": "text",
         "mode": "disaggregated", "policy": "train_batch", "window": 4, "dispatch": "shuffled",
         "seed": 0, "groups": [{"group": i, "source": "ab"[i % 2], "sent": 0.0, "done": 1.0,
                                "seconds": 1.0} for i in range(8)]
         + [{"group": 9, "source": "a", "sent": 0.0, "done": 9.0, "seconds": None}],
         "step_seconds": [5.0, 5.0, 0.01, 0.01]}
  raw.update(over)
  path.mkdir(exist_ok=True)
  (path / "trace.json").write_text(json.dumps(raw))
  return path


def test_trace_mode_replays_the_recorded_times(tmp_path):
  """One worker, one group at a time, every group 1 s, steps 0.01 s: a group of n = 2
  trajectories a second is the throughput, whatever the policy; the untimed group
  (its call compiled) and the first train batch's step times (compiling) are left out."""
  trace = Trace.from_run(str(write_trace(tmp_path / "run")))
  assert trace.group_seconds == {"a": (1.0,) * 4, "b": (1.0,) * 4}
  assert trace.step_seconds == (0.01, 0.01) and trace.concurrent_groups == 1
  for policy, window in (("train_batch", 4), ("constraint_preserving", 2)):
    res = simulate(trace.sim_config(train_batches=6), policy, window=window)
    got = steady_state(res, trace.spec, skip_steps=2)
    assert got["traj_per_s"] == pytest.approx(2.0, rel=0.02), (policy, got)
    assert got["quota_violations"] == 0
  # predict: the run's own train batches read from a longer simulation (no drain at the end).
  run = str(tmp_path / "run")
  got = predict(run, "train_batch", 4, "shuffled", seed=0, train_batches=6, skip_steps=2)
  assert got["traj_per_s"] == pytest.approx(2.0, rel=0.02)
  # Train-batch admission waits for a whole train batch: staler than admitting early.
  tb = steady_state(simulate(trace.sim_config(6), "train_batch", window=4), trace.spec, 2)
  cp = steady_state(simulate(trace.sim_config(6), "constraint_preserving", window=2),
                    trace.spec, 2)
  assert cp["arch_staleness_mean"] < tb["arch_staleness_mean"]
  # An agent loop runs every group it is sent: the window sizes its slots.
  agent = Trace.from_run(str(write_trace(tmp_path / "agent", suite="agentic")))
  assert agent.concurrent_groups is None
  assert agent.sim_config(6, window=8).slots == 8 * 2


def test_bad_traces_are_named(tmp_path):
  with pytest.raises(TraceError, match=r"trace.json does not exist"):
    Trace.from_run(str(tmp_path))
  only_a = [{"group": 0, "source": "a", "sent": 0.0, "done": 1.0, "seconds": 1.0}]
  with pytest.raises(TraceError, match=r"no timed group of source\(s\) \['b'\]"):
    Trace.from_run(str(write_trace(tmp_path / "r1", groups=only_a)))
  with pytest.raises(TraceError, match=r"2 step times, none after the first 2 left out"):
    Trace.from_run(str(write_trace(tmp_path / "r2", step_seconds=[1.0, 1.0])))


def runs(policy, dispatch, window, thr, stale, seeds=(0, 1, 2), violations=0):
  return [{"policy": policy, "dispatch": dispatch, "window": window, "seed": s,
           "traj_per_s": t, "arch_staleness_mean": a, "arch_staleness_p99": 2 * a,
           "quota_violations": violations} for s, t, a in zip(seeds, thr, stale)]


def test_matched_reading_of_real_runs():
  G = 16
  data = (runs("train_batch", "shuffled", 16, [10, 11, 12], [4.0, 4.0, 5.0])
          + runs("train_batch", "shuffled", 32, [20, 21, 22], [8.0, 8.0, 8.0])
          + runs("train_batch", "shuffled", 64, [30, 30, 30], [16.0, 16.0, 16.0])
          + runs("constraint_preserving", "shuffled", 4, [8, 9, 10], [1.0, 1.0, 1.0])
          + runs("constraint_preserving", "shuffled", 8, [11, 12, 13], [2.0, 1.0, 2.5])
          + runs("constraint_preserving", "shuffled", 16, [21, 22, 23], [3.0, 3.0, 3.0])
          + runs("constraint_preserving", "quota_aware", 8, [12, 12, 12], [1.0, 1.0, 1.0],
                 violations=1)
          + runs("train_batch", "shuffled", 8, [1, 1, 1], [9.0, 9.0, 9.0]))
  out = matched.reduction_by_baseline_window(data, G)
  assert set(out) == {"G", "2G", "4G"}
  g1 = out["G"]  # target 11: shuffled W=8 (mean 12) matches; quota_aware breaks quotas
  assert g1["matched"] and g1["dispatch"] == "shuffled" and g1["matched_window"] == 8
  assert g1["by_seed"] == pytest.approx({0: 0.5, 1: 0.75, 2: 0.5})
  assert g1["mean"] == pytest.approx(np.mean([0.5, 0.75, 0.5]))
  assert g1["within_spread"]  # 11..13 overlaps the baseline's 10..12
  assert g1["candidates"]["quota_aware"]["quota_violations"] == 3
  tb8 = g1["train_batch_at_matched_window"]  # the window alone: staler here, paired by seed
  assert tb8["reduction"]["mean"] == pytest.approx(np.mean([1 - 9 / 4, 1 - 9 / 4, 1 - 9 / 5]))
  assert tb8["constraint_preserving_vs_it"]["by_seed"][1] == pytest.approx(1 - 1 / 9)
  g2 = out["2G"]  # target 21: W=16 (mean 22), above the baseline's spread? 21..23 vs 20..22
  assert g2["matched_window"] == 16 and g2["within_spread"]
  assert g2["mean"] == pytest.approx(1 - 3 / 8)
  assert not out["4G"]["matched"] and "mean" not in out["4G"]  # nothing reaches 30 traj/s
  front = matched.frontier(data)
  assert len(front) == 8 and front[0]["policy"] == "constraint_preserving"
  assert matched.relative_errors([(1.1, 1.0), (1.0, 2.0)]) == pytest.approx(
      {"mean": 0.3, "max": 0.5, "n": 2})


def test_the_real_job_figure_and_section(tmp_path):
  """scripts/figures_real_job.py draws the frontier and writes the table from a
  real_staleness.py JSON (here made of the synthetic runs above)."""
  import sys
  sys.path.insert(0, "scripts")
  import figures_real_job
  data = (runs("train_batch", "shuffled", 16, [10, 11, 12], [4.0, 4.0, 5.0])
          + runs("constraint_preserving", "shuffled", 8, [11, 12, 13], [2.0, 1.0, 2.5]))
  sim = [{**r, "traj_per_s": 1.1 * r["traj_per_s"]} for r in data]
  r = {"gin_file": "configs/agentic_tails.gin", "G": 16, "g": 4, "seeds": [0, 1, 2],
       "train_batches": 20, "skip_train_batches": 3, "windows": [4, 8],
       "dispatch": ["shuffled"],
       "reduction_by_baseline_window": matched.reduction_by_baseline_window(data, 16),
       "frontier": matched.frontier(data), "sim_frontier": matched.frontier(sim),
       "sim_relative_error": {"mean": 0.1, "max": 0.1, "n": 12,
                              "arch_staleness_mean": {"mean": 0.0}, "traj_per_s": {"mean": 0.1}}}
  r["command"] = figures_real_job.command_of(r)
  assert "--windows 1,2 --dispatch shuffled" in r["command"]
  figures_real_job.frontier_plot(r, "agentic", str(tmp_path / "f.png"))
  assert (tmp_path / "f.png").stat().st_size > 0
  text = "\n".join(figures_real_job.real_job_section({"agentic": r}))
  assert "| train_batch W=G (16) | 11.0 [10.0, 12.0] | 4.33 | constraint_preserving+shuffled W=8" \
      in text
  assert "0.583 [0.500, 0.750] | yes | W < G: not run |" in text
