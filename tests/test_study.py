"""The study runner (scripts/study.py) and its statistics (knittrans_jax/study/)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from knittrans_jax.study.stats import bootstrap_ci, gap_closed


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


@pytest.mark.slow
def test_runner_on_a_two_seed_grid_resumes(tmp_path):
  out = tmp_path / "study"
  gin = tmp_path / "grid.gin"
  gin.write_text(
      "study.base_gin = 'configs/text_grpo_test.gin'\n"
      "study.seeds = (0, 1)\n"
      "study.common_bindings = ['JobConfig.train_batches = 1']\n"
      "study.configurations = {'colocated': [\"JobConfig.mode = 'colocated'\"],\n"
      "                        'cp W=G': ['JobConfig.window = 8']}\n")
  cmd = [sys.executable, "scripts/study.py", "--gin_file", str(gin), "--out", str(out)]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "XLA_FLAGS": ""})
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.load(open(out / "results.json"))
  assert [(r["configuration"], r["seed"]) for r in res["runs"]] == [
      ("colocated", 0), ("colocated", 1), ("cp W=G", 0), ("cp W=G", 1)]
  assert all(r["steps"] == 2 for r in res["runs"])
  s = res["summary"]["cp W=G"]
  assert s["seeds"] == [0, 1] and s["quota_violations"] == 0
  assert s["reward_last_ci95"][0] <= s["reward_last_mean"] <= s["reward_last_ci95"][1]
  assert res["summary"]["colocated"]["arch_staleness_mean_mean"] == 0
  assert "| cp W=G | 2 |" in (out / "results.md").read_text()
  # Resumable: a second call reruns nothing (every run's summary.json exists).
  stamp = os.path.getmtime(out / "runs" / "cp_W=G" / "seed1" / "summary.json")
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "XLA_FLAGS": ""})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.path.getmtime(out / "runs" / "cp_W=G" / "seed1" / "summary.json") == stamp
