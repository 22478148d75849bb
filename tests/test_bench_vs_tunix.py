"""scripts/bench_vs_tunix.py: one workload for both sides, read from our gin config;
the steady rate; the whole comparison at toy size where Tunix's venv is installed."""
import json
import os
import subprocess
import sys

import pytest
from script_helpers import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
  return load_script("bench_vs_tunix")


def test_workloads_come_from_our_configs():
  import jax
  from flax import nnx

  from knittrans_jax.models import DecoderConfig, DecoderLM
  bench = _bench()
  text = bench.workload_of("text", [], steps=7)
  agentic = bench.workload_of("agentic", bench.DRY["agentic"], steps=3)
  assert (text["groups"], text["n"], text["mini_batches"]) == (16, 8, 1)
  assert text["quota"] == {"nearest": 6, "count": 5, "chain": 5}
  assert text["optimizer"]["total_steps"] == 7 and text["loss"]["clip_high"] == 0.28
  assert text["sampler"]["max_new_tokens"] == 16 and "agent" not in text
  assert agentic["quota"] == {"hop": 2, "nearest": 2} and agentic["agent"]["max_turns"] == 8
  assert agentic["agentic_tasks"]["latency"]["median_s"] == 0.01
  # The shape both sides build: 304,256 parameters (the Tunix side counts its own).
  cfg = DecoderConfig(**{**text["model"], "mrope_section": tuple(text["model"]["mrope_section"])})
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: DecoderLM(cfg, nnx.Rngs(0)))
  assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == 304256
  # The equal-work control: the same workload, the policy held (both sides read this).
  fixed = bench.workload_of("text", [bench.FIXED_POLICY], steps=7)
  assert fixed["optimizer"]["learning_rate"] == 1e-9 < text["optimizer"]["learning_rate"]
  assert {k: v for k, v in fixed.items() if k != "optimizer"} == {
      k: v for k, v in text.items() if k != "optimizer"}


def test_steady_rate_leaves_out_the_warm_up():
  bench = _bench()
  # 4 steps of 10 trajectories ending at 5, 6, 7, 9 s: after 1 warm-up step, 30 in 4 s.
  assert bench.steady([5.0, 6.0, 7.0, 9.0], [10] * 4, 1) == pytest.approx(7.5)
  assert bench.steady([2.0, 4.0], [10, 10], 0) == pytest.approx(5.0)
  with pytest.raises(ValueError, match="2 steps"):
    bench.steady([1.0, 2.0], [10, 10], 1)


def test_dry_run_both_workloads(tmp_path):
  bench = _bench()
  venv = os.path.join(ROOT, ".cache", "venv-tunix")
  if bench.tunix_python(venv) is None:
    pytest.skip(f"Tunix's venv is not installed at {venv}: `python scripts/bench_vs_tunix.py "
                "--dry_run --json F` builds it (a few minutes), then this runs")
  out = tmp_path / "vs.json"
  proc = subprocess.run([sys.executable, "scripts/bench_vs_tunix.py", "--dry_run", "--json",
                         str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(out.read_text())
  for name in ("text", "agentic"):
    w = result[name]
    assert w["ratio_steady"] == w["disaggregated"]["ratio_steady"] > 0
    assert w["colocated"]["ratio_steady"] > 0
    (pair,) = w["pairs"]
    runs = {(r["side"], r.get("mode", r.get("off_policy_steps"))): r for r in pair["runs"]}
    tunix = [r for r in pair["runs"] if r["side"] == "tunix"]
    assert tunix and all(r["params"] == 304256 for r in tunix)
    assert all(r["steps"] == 3 and r["load_before"] >= 0 for r in pair["runs"])
    assert runs[("ours", "disaggregated")]["quota_violations"] == 0
    assert all(r["quota_violations"] == 0 for r in tunix)
  # Text, both sides: response lengths, the ratio in response tokens, the fixed-policy pairs.
  text = result["text"]
  assert all(r["response_len_steady"] > 0 for r in text["pairs"][0]["runs"])
  assert text["disaggregated"]["ratio_steady_response_tokens"] > 0
  fixed = text["fixed_policy"]
  assert fixed["workload"]["optimizer"]["learning_rate"] == 1e-9
  assert fixed["disaggregated"]["ratio_steady"] > 0 and fixed["colocated"]["ratio_steady"] > 0
  assert "fixed_policy" not in result["agentic"]
