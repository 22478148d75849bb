import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_store_demo_runs_and_verifies(tmp_path):
  """The `make run` job end to end, scaled down: producers, polling, verified read-back."""
  workdir = tmp_path / "demo"
  proc = subprocess.run(
      [sys.executable, "scripts/store_demo.py", "--gin_file", "configs/store_demo.gin",
       "--gin_bindings", "store_demo.producers = 2", "--gin_bindings",
       "store_demo.groups_per_producer = 8", "--workdir", str(workdir)],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["trajectories"] == 2 * 8 * 8 and summary["verified"] is True
  # The read-back moved every committed token once (int32 token, float32 log-prob,
  # uint8 mask: 9 bytes), and the rates are those bytes and counts over the times.
  assert summary["payload_MB"] * 2**20 == summary["tokens"] * 9
  assert summary["tokens"] >= summary["trajectories"] * 2
  assert summary["read_MBps"] == pytest.approx(summary["payload_MB"] / summary["read_s"])
  assert summary["write_traj_per_s"] == pytest.approx(summary["trajectories"] / summary["write_s"])
  assert 0 < summary["read_s"] < 300 and 0 < summary["write_s"] < 300
  assert "store_demo.producers = 2" in (workdir / "operative_config.gin").read_text()
