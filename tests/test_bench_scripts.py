"""Benchmarks run and write every key they promise (no speed asserted here)."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_store_writes_its_json(tmp_path):
  out = tmp_path / "bench.json"
  proc = subprocess.run([sys.executable, "scripts/bench_store.py", "--json", str(out), "--mib", "2",
                         "--reps", "1", "--micro_reps", "5", "--payload_checksum"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  for key in ("write_MBps", "read_MBps", "microbatch_read_MBps", "memcpy_MBps", "read_vs_memcpy"):
    assert result[key] > 0, key
  assert result["read_vs_memcpy"] == pytest.approx(result["read_MBps"] / result["memcpy_MBps"])
  assert result["payload_MiB"] >= 2 and result["with_payload_checksum"]["payload_checksum"]
  assert "read / memcpy" in proc.stdout


def test_bench_admission_writes_its_json(tmp_path):
  out = tmp_path / "adm.json"
  proc = subprocess.run([sys.executable, "scripts/bench_admission.py", "--json", str(out),
                         "--G", "64", "--M", "8", "--train_batches", "2"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["admit_p99_us"] >= result["admit_p50_us"] > 0
  assert set(result["policies"]) == {"constraint_preserving", "train_batch", "fifo"}
  assert result["policies"]["constraint_preserving"]["admit_calls"] > 16
