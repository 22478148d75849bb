"""The study runner (scripts/study.py) and its statistics (knittrans_jax/study/)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from knittrans_jax.study.curves import eval_curve, final_reward, first_reaching
from knittrans_jax.study.stats import bootstrap_ci, gap_closed, linear_fit


def test_bootstrap_interval_covers_the_mean_and_is_seeded():
  x = [0.30, 0.35, 0.28, 0.41, 0.33]
  lo, hi = bootstrap_ci(x)
  assert lo < np.mean(x) < hi and (lo, hi) == bootstrap_ci(x)
  assert bootstrap_ci([0.5]) == (0.5, 0.5)
  with pytest.raises(ValueError, match="finite values"):
    bootstrap_ci([0.1, float("nan")])


def test_gap_closed():
  share, (lo, hi) = gap_closed([0.5, 0.5], baseline=[0.2, 0.2], reference=[0.8, 0.8])
  assert share == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
  share, (lo, hi) = gap_closed([0.4, 0.6, 0.5], [0.1, 0.3, 0.2], [0.7, 0.9, 0.8])
  assert lo < share < hi


def test_linear_fit_recovers_a_slope_with_an_interval():
  x = [0, 0, 1, 1, 2, 2, 4, 4]
  y = [0.5 - 0.05 * v + e for v, e in zip(x, [0.01, -0.01, 0.02, -0.02, 0.0, 0.01, -0.01, 0.0])]
  slope, intercept, (lo, hi) = linear_fit(x, y)
  assert slope == pytest.approx(-0.05, abs=0.01) and intercept == pytest.approx(0.5, abs=0.02)
  assert lo < slope < hi < 0
  with pytest.raises(ValueError, match="no slope"):
    linear_fit([1, 1, 1], [0.1, 0.2, 0.3])


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


@pytest.mark.slow
def test_runner_on_a_two_seed_grid_resumes(tmp_path):
  out = tmp_path / "study"
  gin = tmp_path / "grid.gin"
  gin.write_text(
      "study.base_gin = 'configs/text_grpo_test.gin'\n"
      "study.seeds = (0, 1)\n"
      "study.train_batches = 2\n"
      "study.threshold = 0.0\n"
      "study.baseline = 'tb'\n"
      "study.reference = 'colocated'\n"
      "study.common_bindings = ['EvalConfig.every_steps = 1', 'EvalConfig.prompts_per_source = 2']\n"
      "study.configurations = {'colocated': [\"JobConfig.mode = 'colocated'\"],\n"
      "                        'tb': [\"JobConfig.policy = 'train_batch'\"],\n"
      "                        'cp W=G': ['JobConfig.window = 8']}\n"
      "study.dose_configurations = ['tb', 'cp W=G']\n")
  cmd = [sys.executable, "scripts/study.py", "--gin_file", str(gin), "--out", str(out)]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "XLA_FLAGS": ""})
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.load(open(out / "results.json"))
  assert [(r["configuration"], r["seed"]) for r in res["runs"]] == [
      (c, s) for c in ("colocated", "tb", "cp W=G") for s in (0, 1)]
  for r in res["runs"]:
    assert r["steps"] == 4 and [c[0] for c in r["curve"]] == [1, 2, 3, 4]
    assert r["final_reward"] == r["curve"][-1][2] and r["steps_to_threshold"] == 1
    assert 0 < r["traj_per_s"] and r["eval_s"] > 0
  s = res["summary"]["cp W=G"]
  assert s["seeds"] == [0, 1] and s["quota_violations"] == 0 and s["reached_threshold"] == 2
  assert s["final_reward_ci95"][0] <= s["final_reward_mean"] <= s["final_reward_ci95"][1]
  assert "gap_closed" in s and "gap_closed" not in res["summary"]["tb"]
  assert res["summary"]["colocated"]["arch_staleness_mean_mean"] == 0
  assert len(res["dose_response"]["points"]) == 4
  assert "| cp W=G | 2 |" in (out / "results.md").read_text()
  for png in ("learning_curves.png", "dose_response.png"):
    assert (out / png).stat().st_size > 0
  # Resumable: a second call reruns nothing (every run's summary.json exists).
  stamp = os.path.getmtime(out / "runs" / "cp_W=G" / "seed1" / "summary.json")
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "XLA_FLAGS": ""})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.path.getmtime(out / "runs" / "cp_W=G" / "seed1" / "summary.json") == stamp
  # A misnamed baseline is refused before anything runs.
  bad = subprocess.run(cmd + ["--gin_bindings", "study.baseline = 'tb W=2G'"],
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "study.baseline = 'tb W=2G' is not one of" in bad.stderr
