"""scripts/plan_layout.py: ahead-of-time compiled memory plans for every mesh file."""
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def plan(tmp_path, *bindings, seq_len=128, mesh=()):
  out = tmp_path / "plan.json"
  cmd = [sys.executable, "scripts/plan_layout.py", "--model", "configs/models/tiny_qwen2.gin",
         "--devices", "8", "--seq_len", str(seq_len), "--json", str(out)]
  for m in mesh:
    cmd += ["--mesh", m]
  for b in bindings:
    cmd += ["--gin_bindings", b]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "XLA_FLAGS": ""})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.load(open(out)), proc.stdout


def test_every_mesh_file_is_planned_and_sharding_shows(tmp_path):
  result, printed = plan(tmp_path)
  plans = {p["mesh"]: p for p in result["plans"]}
  assert set(plans) == {"dp", "fsdp", "fsdp_tp"} and "fsdp_tp" in printed
  dp, fsdp, tp = plans["dp"], plans["fsdp"], plans["fsdp_tp"]
  # dp replicates: each device holds every float32 parameter; Adam keeps two moments.
  assert dp["params_bytes"] == 4 * dp["params"]
  assert dp["opt_state_bytes"] >= 2 * dp["params_bytes"]
  assert dp["mesh_shape"] == {"data": 8} and tp["mesh_shape"] == {"fsdp": 4, "tensor": 2}
  # fsdp splits the parameters (all but a few small replicated ones) 8 ways.
  assert fsdp["params_bytes"] < dp["params_bytes"] / 4
  assert tp["params_bytes"] < dp["params_bytes"] / 4
  for p in plans.values():
    assert p["micro_temp_bytes"] > 0 and p["peak_bytes"] > p["params_bytes"] + p["opt_state_bytes"]


def test_remat_and_bfloat16_show_in_the_plan(tmp_path):
  dp = ("configs/mesh/dp.gin",)
  base, _ = plan(tmp_path, "DecoderConfig.depth = 4", mesh=dp)
  remat, _ = plan(tmp_path, "DecoderConfig.depth = 4", "DecoderConfig.remat = 'full'", mesh=dp)
  bf16, _ = plan(tmp_path, "DecoderConfig.depth = 4", "DecoderConfig.param_dtype = 'bfloat16'",
                 "DecoderConfig.dtype = 'bfloat16'", mesh=dp)
  b, r, h = (x["plans"][0] for x in (base, remat, bf16))
  assert r["saved_activation_bytes"] < b["saved_activation_bytes"] / 2
  assert h["params_bytes"] == b["params_bytes"] // 2
  assert h["saved_activation_bytes"] < b["saved_activation_bytes"]
  assert math.isclose(r["params_bytes"], b["params_bytes"])


def test_the_step_forms_no_vocab_sized_logits_unless_asked(tmp_path):
  dp = ("configs/mesh/dp.gin",)
  chunked, printed = plan(tmp_path, "LossConfig.logprob_chunk = 32", mesh=dp)
  assert chunked["logits_materialised"] is False and "chunked" in printed
  p = chunked["layouts"]["dp"]
  assert p == chunked["plans"][0] and p["peak_bytes"] > 0 and p["compile_s"] > 0
  assert p["largest_vocab_activation"][1] == 32  # one chunk of 32 tokens at a time
  out = tmp_path / "full.json"
  proc = subprocess.run([sys.executable, "scripts/plan_layout.py", "--model",
                         "configs/models/tiny_qwen2.gin", "--devices", "8", "--seq_len", "128",
                         "--mesh", dp[0], "--full_logits", "--json", str(out)],
                        capture_output=True, text=True, timeout=600, env={**os.environ, "XLA_FLAGS": ""})
  assert proc.returncode == 0, proc.stderr[-3000:]
  full = json.load(open(out))
  assert full["logits_materialised"] is True and full["layouts"]["dp"]["largest_vocab_activation"][1] >= 127
  # The whole logits cost temporaries the chunked step does not hold.
  assert full["layouts"]["dp"]["micro_temp_bytes"] > p["micro_temp_bytes"]


def test_a_kl_reference_is_planned(tmp_path):
  dp = ("configs/mesh/dp.gin",)
  base, _ = plan(tmp_path, "LossConfig.logprob_chunk = 32", mesh=dp)
  kl, printed = plan(tmp_path, "LossConfig.logprob_chunk = 32", "LossConfig.kl_coef = 0.1", mesh=dp)
  b, k = base["layouts"]["dp"], kl["layouts"]["dp"]
  assert b["reference_bytes"] == 0 and k["reference_bytes"] == k["params_bytes"]
  assert k["peak_bytes"] >= b["peak_bytes"] + k["params_bytes"] and "reference" in printed
