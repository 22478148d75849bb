"""scripts/device_bench.py: the --dry_run writes every figure it promises; MFU and bad flags."""
import functools
import json
import math
import os
import subprocess
import sys

import pytest
from script_helpers import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("qwen2_5_0_5b", "qwen2_5_1_5b")


@functools.cache
def _script():
  return load_script("device_bench", register=True)  # its dataclasses look it up


def _positive(value, where):
  assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (where, value)


@pytest.mark.slow  # a subprocess, ~15 s: in `make test`, not `make test-fast`
def test_dry_run_writes_every_section(tmp_path):
  out = tmp_path / "bench.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "scripts/device_bench.py", "--dry_run", "--json", str(out),
                         "--workdir", str(tmp_path / "work")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  r = json.loads(out.read_text())
  assert r["config"]["dry_run"] and r["config"]["platform"] == "cpu"
  # CPU is not in the peak table: MFU null, with the reason naming the override.
  assert r["peak_flops"]["value"] is None and "--peak_flops" in r["peak_flops"]["reason"]
  assert set(r["train"]) == set(r["rollout"]) == set(r["weights"]) == set(MODELS)
  for name in MODELS:
    t = r["train"][name]
    for key in ("tokens_per_s", "update_s", "flops_per_token", "model_flops_per_s", "params",
                "matmul_params", "tokens", "warmup_s", "section_s"):
      _positive(t[key], f"train.{name}.{key}")
    assert t["compile_s"] >= 0 and 0 <= t["padding_fraction"] < 1
    assert t["mfu"] is None and "cpu" in t["mfu_reason"]
    # The per-token FLOPs are 6 N plus the attention term, so above 6 N.
    assert t["flops_per_token"] > 6 * t["matmul_params"]
    assert t["tokens_per_s"] == pytest.approx(t["tokens"] / t["update_s"])
    ro = r["rollout"][name]
    for key in ("tokens_per_s", "call_s", "tokens_per_call", "warmup_s"):
      _positive(ro[key], f"rollout.{name}.{key}")
    w = r["weights"][name]
    for key in ("per_version_s", "publish_s", "subscribe_s", "load_s", "copy_s", "weight_bytes",
                "publish_bytes_per_s"):
      _positive(w[key], f"weights.{name}.{key}")
    # Published in the engine's dtype: bfloat16, 2 bytes a parameter.
    assert w["weight_dtype"] == "bfloat16" and w["weight_bytes"] == 2 * t["params"]
    assert w["transport"] in ("shm", "files")
  h = r["h2d"]
  for key in ("h2d_bytes_per_s", "read_bytes_per_s", "end_to_end_bytes_per_s", "batch_bytes",
              "payload_bytes", "put_s", "read_s"):
    _positive(h[key], f"h2d.{key}")
  assert set(r["entry_s"]) == {f"{s}/{m}" for s in ("train", "rollout", "weights")
                               for m in MODELS} | {"h2d"}
  assert all(v > 0 for v in r["entry_s"].values()) and r["total_s"] > 0
  assert "train/qwen2_5_0_5b:" in proc.stdout + proc.stderr  # each entry's time printed


def test_peak_flops_and_mfu():
  db = _script()
  given = db.peak_flops("cpu", 2e12)
  assert given == {"value": 2e12, "source": "--peak_flops", "reason": None}
  assert db.mfu_fields(4e12, 2.0, given, 1) == {"mfu": 1.0, "mfu_reason": None}
  assert db.mfu_fields(4e12, 2.0, given, 2)["mfu"] == 0.5  # every device's peak counts
  unknown = db.peak_flops("cpu")
  assert unknown["value"] is None and "'cpu'" in unknown["reason"]
  assert db.mfu_fields(1.0, 1.0, unknown, 1) == {"mfu": None, "mfu_reason": unknown["reason"]}
  for kind, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                     ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                     ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5p", 459e12),
                     ("TPU v6 lite", 918e12)):
    assert db.peak_flops(kind)["value"] == peak, kind
    assert "spec" in db.peak_flops(kind)["source"] or "datasheet" in db.peak_flops(kind)["source"]


def test_train_flops_formula():
  db = _script()
  from knittrans_jax.models import DecoderConfig
  cfg = DecoderConfig(vocab_size=10, width=8, depth=2, heads=2, mlp_width=16)
  # An untied input table multiplies nothing: N leaves it out.
  assert db.matmul_params(cfg, 1000) == 1000 - 10 * 8
  tied = DecoderConfig(vocab_size=10, width=8, depth=2, heads=2, mlp_width=16,
                       tie_embeddings=True)
  assert db.matmul_params(tied, 1000) == 1000
  # Trajectories of 3 and 1 tokens: 6 N per token + 6 * layers * heads * head_dim * L (L + 1).
  assert db.train_flops(cfg, 100, [3, 1]) == 6 * 100 * 4 + 6 * 2 * 2 * 4 * (3 * 4 + 1 * 2)


@pytest.mark.parametrize("argv, words", [
    (["--sections", "train,trian"], ["--sections", "'trian'"]),
    (["--models", "configs/models/nope.gin"], ["--models", "configs/models/nope.gin"]),
    (["--models", "configs/models/qwen3_0_6b.gin,configs/mesh/dp.gin"],
     ["--models", "'configs/mesh/dp.gin'", "binds no DecoderConfig"]),
    (["--models", " configs/models/tiny_qwen2.gin ", "--sections", "h2d"], None),
    (["--peak_flops", "-1"], ["--peak_flops", "-1"]),
    (["--attention", "flash"], ["--attention", "'flash'"]),
    (["--rows", "0"], ["--rows", "0"]),
])
def test_bad_flags_name_the_flag_and_value(argv, words, capsys):
  db = _script()
  if words is None:  # good flags parse
    args = db.parse_args(argv)
    assert args.models == ["configs/models/tiny_qwen2.gin"] and args.sections == ["h2d"]
    return
  with pytest.raises(SystemExit) as e:
    db.parse_args(argv)
  message = str(e.value.code) + capsys.readouterr().err
  for w in words:
    assert w in message, (w, message)
