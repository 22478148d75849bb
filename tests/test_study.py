"""The study runner (scripts/study.py) and its statistics (knittrans_jax/study/)."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from knittrans_jax.rollout.worker import one_device_xla_flags
from knittrans_jax.study.curves import eval_curve, final_reward, first_reaching
from knittrans_jax.study.stats import (paired_difference, paired_gap_closed, saturating_fit,
                                       t_interval)

# One device per run; the suite's other XLA flags kept.
ONE_DEVICE = one_device_xla_flags(os.environ.get("XLA_FLAGS", ""))


def test_t_interval_covers_the_mean_and_widens_with_few_seeds():
  x = [0.30, 0.35, 0.28, 0.41, 0.33]
  lo, hi = t_interval(x)
  assert lo < np.mean(x) < hi
  # Student-t 95% with 4 degrees of freedom: 2.776 standard errors each side.
  half = 2.7764451 * np.std(x, ddof=1) / np.sqrt(5)
  assert (lo, hi) == pytest.approx((np.mean(x) - half, np.mean(x) + half))
  assert t_interval([0.5]) == (0.5, 0.5)
  with pytest.raises(ValueError, match="finite values"):
    t_interval([0.1, float("nan")])


def test_paired_statistics_use_the_pairing():
  rng = np.random.default_rng(0)
  base = rng.normal(0.2, 0.05, 10)  # seeds differ a lot; the effect within a seed is steady
  ref = base + 0.2 + rng.normal(0, 0.005, 10)
  pol = base + 0.1 + rng.normal(0, 0.005, 10)
  diff, (lo, hi) = paired_difference(pol, base)
  assert diff == pytest.approx(0.1, abs=0.01) and 0.09 < lo < diff < hi < 0.11
  share, (lo, hi) = paired_gap_closed(pol, base, ref)
  assert share == pytest.approx(0.5, abs=0.05) and 0.4 < lo < share < hi < 0.6
  # Unpaired, the same numbers give a far wider interval of the difference.
  assert hi - lo < 0.5 * (t_interval(pol)[1] - t_interval(pol)[0])
  assert paired_gap_closed(pol, base, ref) == (share, (lo, hi))  # seeded
  with pytest.raises(ValueError, match="same >= 2 seeds"):
    paired_gap_closed(pol[:3], base, ref)


def test_saturating_fit_recovers_a_curve_a_line_misstates():
  x = np.repeat([0.0, 1.0, 2.0, 4.0, 8.0], 3)
  y = 0.2 + 0.2 * np.exp(-x / 1.5) + np.tile([0.005, -0.005, 0.0], 5)
  f = saturating_fit(x, y)
  assert f["top"] == pytest.approx(0.4, abs=0.01) and f["floor"] == pytest.approx(0.2, abs=0.01)
  assert f["scale"] == pytest.approx(1.5, rel=0.1) and f["rmse"] < 0.01
  assert saturating_fit([0, 0, 1, 1], [0.3, 0.3, 0.2, 0.2]) is None  # two x: not identified


def test_curve_summaries():
  records = [{"step": s, "time_s": 2.0 * s, "eval_s": 0.5, **(
      {"eval": {"greedy": 0.1 * s, "sampled": 0.05 * s}} if s % 2 == 0 else {})}
      for s in range(1, 21)]
  curve = eval_curve(records, "sampled")
  assert curve[0] == (2, 3.5, pytest.approx(0.1)) and len(curve) == 10
  assert final_reward(curve, 20) == pytest.approx(1.0)  # only step 20 is in the last 10%
  assert final_reward(curve, 20, tail=0.25) == pytest.approx((0.8 + 0.9 + 1.0) / 3)
  assert first_reaching(curve, 0.5) == (10, 19.5) and first_reaching(curve, 2.0) is None
  with pytest.raises(ValueError, match="no held-out evaluation"):
    eval_curve([{"step": 1, "time_s": 1.0}])
  with pytest.raises(ValueError, match="unknown"):
    eval_curve(records, "best")


CP = "constraint_preserving+quota_aware W=1.5G"


@pytest.mark.slow
def test_runner_on_the_agentic_study_at_toy_size_resumes(tmp_path, monkeypatch):
  """configs/study/agentic.gin (issue 45's pre-registered study) on the test-size
  agentic job: three of its configurations (the train-batch one at W=1.5G as the
  baseline too: one run fewer a seed), two seeds, one train batch (two steps) each."""
  out = tmp_path / "study"
  gin = tmp_path / "grid.gin"
  gin.write_text(
      "include 'configs/study/agentic.gin'\n"
      "study.base_gin = 'configs/agentic_test.gin'\n"
      "study.seeds = (0, 1)\n"
      "study.train_batches = 1\n"
      "study.threshold = 0.0\n"
      # No tool sleeps, 6 groups a train batch (not 8): the grid's machinery, not its tails.
      "study.common_bindings = ['EvalConfig.every_steps = 1', 'EvalConfig.prompts_per_source = 2',\n"
      "                         'ToolLatency.median_s = 0.0',\n"
      "                         'TrainBatchSpec.source_quota = {\"hop\": 4, \"nearest\": 2}',\n"
      "                         'TrainBatchSpec.groups_per_batch = 6']\n"
      "study.selection_seeds = (5, 6)\n"
      "study.configurations = {\n"
      "  'synchronous': [\"JobConfig.mode = 'synchronous'\"],\n"
      "  'train_batch W=1.5G': [\"JobConfig.policy = 'train_batch'\", \"JobConfig.window = 24\"],\n"
      f"  '{CP}': [\"JobConfig.policy = 'constraint_preserving'\", \"JobConfig.window = 24\",\n"
      "             \"JobConfig.dispatch = 'quota_aware'\"]}\n"
      "study.baseline = 'train_batch W=1.5G'\n"
      f"study.dose_configurations = ['train_batch W=1.5G', '{CP}']\n"
      "study.parallel = 2\n")  # two runs at a time: results still in grid order
  cmd = [sys.executable, "scripts/study.py", "--gin_file", str(gin), "--out", str(out)]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "XLA_FLAGS": ONE_DEVICE})
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.load(open(out / "results.json"))
  names = ["synchronous", "train_batch W=1.5G", CP]
  assert [(r["configuration"], r["seed"]) for r in res["runs"]] == [
      (c, s) for c in names for s in (0, 1)]
  for r in res["runs"]:
    assert r["steps"] == 2 and [c[0] for c in r["curve"]] == [1, 2]
    assert r["final_reward"] == r["curve"][-1][2] and r["steps_to_threshold"] == 1
    assert 0 < r["traj_per_s"] and r["eval_s"] > 0
  s = res["summary"][CP]
  assert s["seeds"] == [0, 1] and s["quota_violations"] == 0 and s["reached_threshold"] == 2
  assert s["final_reward_ci95"][0] <= s["final_reward_mean"] <= s["final_reward_ci95"][1]
  assert "gap_closed" in s and "gap_closed" not in res["summary"]["train_batch W=1.5G"]
  assert res["summary"]["synchronous"]["arch_staleness_mean_mean"] == 0
  # One train batch of toy runs may all see the same staleness: then there is no
  # dose-response to fit and the study says so instead of drawing one.
  levels = {r["arch_staleness_mean"] for r in res["runs"] if r["configuration"] != names[0]}
  if len(levels) < 2:
    assert res["dose_response"] is None and "nothing to fit" in proc.stdout
  else:
    assert len(res["dose_response"]["points"]) == 4
    per = res["dose_response"]["per_configuration"]
    assert [p["configuration"] for p in per] == names[1:] and all(p["runs"] == 2 for p in per)
  # The method is written down; the evaluation prompts were never training prompts.
  assert "Student-t" in res["interval_method"] and "BCa" in res["interval_method"]
  assert res["selection_seeds"] == [5, 6] and res["reported_seeds"] == [0, 1]
  assert res["eval_train_overlap"] == 0 and all(r["eval_train_overlap"] == 0 for r in res["runs"])
  vs = s["vs"]["train_batch W=1.5G"]
  assert vs["seeds"] == 2 and vs["ci95"][0] <= vs["difference"] <= vs["ci95"][1]
  assert f"| {CP} | 2 |" in (out / "results.md").read_text()
  assert (out / "learning_curves.png").stat().st_size > 0
  assert (out / "dose_response.png").exists() == (res["dose_response"] is not None)
  # Resumable: a second call reruns nothing (every run's summary.json exists).
  last = out / "runs" / CP.replace(" ", "_").replace("/", "_") / "seed1" / "summary.json"
  stamp = os.path.getmtime(last)
  spec = importlib.util.spec_from_file_location("study_script", "scripts/study.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  monkeypatch.setattr(sys, "argv", cmd[1:])  # in this process: no run is started
  script.main()
  assert os.path.getmtime(last) == stamp
  # ... but only runs started with the same settings: an edited study file reruns them.
  wd = str(last.parent)
  run = json.load(open(wd + script.RUN_RECORD))
  assert run["base_gin"] == "configs/agentic_test.gin" and "JobConfig.seed = 1" in run["bindings"]
  assert script.plan_run(wd, run) == "reuse"
  assert script.plan_run(wd, {**run, "bindings": run["bindings"][1:]}) == "overwrite"
  os.remove(last)
  os.makedirs(os.path.join(wd, "checkpoints", "2"), exist_ok=True)
  assert script.plan_run(wd, run) == "resume"
  os.remove(wd + script.RUN_RECORD)  # a run from before the record: not trusted
  assert script.plan_run(wd, run) == "overwrite"
  # A misnamed baseline, and settings chosen on a reported seed, are refused before
  # anything runs (in this process: the same function the script calls).
  grid = dict(configurations={"tb": [], "cp W=G": []}, seeds=(0, 1))
  empty = tmp_path / "never"
  with pytest.raises(ValueError, match=r"study.baseline = 'tb W=2G' is not one of"):
    script.study(str(empty), baseline="tb W=2G", **grid)
  with pytest.raises(ValueError, match=r"share \[1\]"):
    script.study(str(empty), selection_seeds=(1, 5), **grid)
  assert not empty.exists()
