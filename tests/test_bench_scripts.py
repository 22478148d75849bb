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
