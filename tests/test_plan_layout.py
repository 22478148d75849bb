"""scripts/plan_layout.py: ahead-of-time compiled memory plans for every mesh file."""
import functools
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from knittrans_jax.rollout.worker import one_device_xla_flags

pytestmark = pytest.mark.slow
# The CLI's own host devices (--devices); the suite's other XLA flags kept.
ONE_DEVICE = one_device_xla_flags(os.environ.get("XLA_FLAGS", ""))

MODEL, DP = "configs/models/tiny_qwen2.gin", "configs/mesh/dp.gin"


def plan(tmp_path, *bindings, seq_len=128, mesh=()):
  out = tmp_path / "plan.json"
  cmd = [sys.executable, "scripts/plan_layout.py", "--model", "configs/models/tiny_qwen2.gin",
         "--devices", "8", "--seq_len", str(seq_len), "--json", str(out)]
  for m in mesh:
    cmd += ["--mesh", m]
  for b in bindings:
    cmd += ["--gin_bindings", b]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "XLA_FLAGS": ONE_DEVICE})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.load(open(out)), proc.stdout


@functools.cache
def plan_dp(*bindings, full_logits=False, seq_len=128, packed=False) -> dict:
  """One layout planned in this process (its 8 host devices): the script's own `plan`,
  without a process start per call; the same plan asked twice is compiled once."""
  spec = importlib.util.spec_from_file_location("plan_layout_script", "scripts/plan_layout.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  return script.plan(MODEL, DP, rows=8, seq_len=seq_len, bindings=list(bindings),
                     full_logits=full_logits, packed=packed)


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


def test_remat_and_bfloat16_show_in_the_plan():
  b = plan_dp("DecoderConfig.depth = 4")
  r = plan_dp("DecoderConfig.depth = 4", "DecoderConfig.remat = 'full'")
  h = plan_dp("DecoderConfig.depth = 4", "DecoderConfig.param_dtype = 'bfloat16'",
              "DecoderConfig.dtype = 'bfloat16'")
  assert r["saved_activation_bytes"] < b["saved_activation_bytes"] / 2
  assert h["params_bytes"] == b["params_bytes"] // 2
  assert h["saved_activation_bytes"] < b["saved_activation_bytes"]
  assert math.isclose(r["params_bytes"], b["params_bytes"])


def test_the_step_forms_no_vocab_sized_logits_unless_asked():
  p = plan_dp("LossConfig.logprob_chunk = 32")
  assert p["logits_materialised"] is False and p["peak_bytes"] > 0 and p["compile_s"] > 0
  assert p["largest_vocab_activation"][1] == 32  # one chunk of 32 tokens at a time
  full = plan_dp(full_logits=True)
  assert full["logits_materialised"] is True and full["largest_vocab_activation"][1] >= 127
  # The whole logits cost temporaries the chunked step does not hold.
  assert full["micro_temp_bytes"] > p["micro_temp_bytes"]


def test_a_kl_reference_is_planned():
  b = plan_dp("LossConfig.logprob_chunk = 32")
  k = plan_dp("LossConfig.logprob_chunk = 32", "LossConfig.kl_coef = 0.1")
  assert b["reference_bytes"] == 0 and k["reference_bytes"] == k["params_bytes"]
  assert k["peak_bytes"] >= b["peak_bytes"] + k["params_bytes"]


def test_blockwise_attention_plans_long_packed_rows_without_the_scores():
  """--packed rows of 1,024 tokens: the masked einsum's temporaries hold [heads, T, T]
  scores, the blockwise attention's do not (docs/training.md, the 7B plan)."""
  e = plan_dp("DecoderConfig.remat = 'full'", seq_len=1024, packed=True)
  b = plan_dp("DecoderConfig.remat = 'full'", "DecoderConfig.attention = 'blockwise'",
              "DecoderConfig.attention_block = 128", seq_len=1024, packed=True)
  assert b["micro_temp_bytes"] < e["micro_temp_bytes"] / 2, (b["micro_temp_bytes"],
                                                             e["micro_temp_bytes"])
