"""scripts/bench_transfer.py on a small VLM workload: its JSON, its figure, and the
image bytes with and without dedup. (tests/conftest.py runs this file's tests on one
worker: both read the transfer_dedup run.)"""
import json
import subprocess
import sys

import pytest
from test_bench_scripts import figures


def bench_transfer(out, *flags):
  proc = subprocess.run([sys.executable, "scripts/bench_transfer.py", "--workload", "vlm",
                         "--json", str(out), "--prompts", "4", "--mini_batches", "2", "--micro", "8",
                         "--seq", "32", *flags], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def transfer_dedup(tmp_path_factory):
  """One run of the VLM transfer benchmark with dedup, for the tests below."""
  return bench_transfer(tmp_path_factory.mktemp("transfer") / "transfer.json")


@pytest.mark.slow
def test_bench_transfer_writes_its_json(transfer_dedup, tmp_path):
  r, stdout = transfer_dedup
  for key in ("exposed_s", "raw_transfer_s"):
    assert r["baseline"][key] > 0 and r["ondemand"][key] >= 0
  assert r["bytes_moved"]["baseline"] > r["bytes_moved"]["ondemand"] > 0
  assert r["exposed_ratio"] > 0 and r["raw_ratio"] > 0
  assert r["trajectories"] == 64 and r["dedup_images"]
  # The prefetching baseline moves the same bytes mini-batch by mini-batch, never
  # more exposed than its own raw transfer; the headline is end to end against it.
  # (How much it hides is the benchmark's figure, not a timed assertion here: the
  # suite runs beside other tests.)
  pre, base = r["baselines"]["centralized_prefetch"], r["baselines"]["centralized"]
  assert base == r["baseline"]
  assert pre["bytes_moved"] == pytest.approx(base["bytes_moved"], rel=0.01)
  assert 0 < pre["exposed_s"] <= pre["raw_transfer_s"]
  assert r["total_ratio"] == pre["total_ratio"] == pytest.approx(
      pre["total_s"] / r["ondemand"]["total_s"])
  assert "centralized_prefetch" in stdout
  fig = figures("transfer").transfer_figure({"vlm": r}, str(tmp_path))["vlm"]
  assert fig["exposed_ratio"] == r["exposed_ratio"]
  assert fig["baseline_exposed_s"] == r["baseline"]["exposed_s"]
  assert (tmp_path / "transfer_latency.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_transfer_no_dedup_moves_an_image_per_trajectory(transfer_dedup, tmp_path):
  dedup = transfer_dedup[0]
  copies, stdout = bench_transfer(tmp_path / "transfer.json", "--no-dedup")
  assert copies["dedup_images"] is False and "copy per trajectory" in stdout
  # 2 mini-batches of 4 prompts x n = 8: without dedup the consumers read 64 image
  # copies, one per trajectory, where with dedup each reads each of its images once a
  # mini-batch (4 to 8 reads a mini-batch over 2 consumers); the baseline's driver
  # reads 64, not 8, and sends 64 either way.
  image = 448 * 448 * 3 * 4
  extra, rest = divmod(copies["bytes_moved"]["ondemand"] - dedup["bytes_moved"]["ondemand"], image)
  assert rest == 0 and 64 - 16 <= extra <= 64 - 8
  assert copies["bytes_moved"]["baseline"] - dedup["bytes_moved"]["baseline"] == 56 * image
