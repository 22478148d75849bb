"""scripts/device_bench.py: the --dry_run writes every figure it promises; bad flags (its
MFU formulas: tests/test_flops.py)."""
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
