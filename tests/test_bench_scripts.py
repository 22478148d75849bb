"""Benchmarks run and write every key they promise (no speed asserted here)."""
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from script_helpers import load_script


@pytest.mark.slow
def test_bench_store_writes_its_json(tmp_path):
  out = tmp_path / "bench.json"
  proc = subprocess.run([sys.executable, "scripts/bench_store.py", "--json", str(out), "--mib", "2",
                         "--reps", "1", "--micro_reps", "5", "--payload_checksum",
                         "--image_groups", "4", "--image_n", "4", "--image_shape", "256,256,3",
                         "--read_trajectories", "8", "--image_reps", "1",
                         "--growth_gb", "0.02", "--growth_step_gb", "0.01",
                         "--growth_dir", str(tmp_path)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  # The unit grows in steps of at least 10 MB to 20 MB, each timed beside plain writes.
  growth = result["append_MBps_by_unit_size"]
  assert len(growth) == 2 and growth[0]["unit_GB"] < growth[1]["unit_GB"]
  assert growth[1]["unit_GB"] >= 0.02 and all(g["MB"] >= 10 for g in growth)
  assert all(g["append_MBps"] > 0 and g["plain_write_MBps"] > 0 for g in growth)
  assert not any(p.name.startswith("bench_store_growth_") for p in tmp_path.iterdir())
  for key in ("write_MBps", "read_MBps", "microbatch_read_MBps", "memcpy_MBps", "read_vs_memcpy",
              "npsave_MBps", "append_vs_npsave", "append_vs_npsave_whole"):
    assert result[key] > 0, key
  # The timed reads returned exactly the payload, equal to what was written, and the
  # ratio is the copy's time over the read's, of the same bytes.
  assert result["read_matches_written"] is True
  assert result["read_bytes_returned"] == [result["payload_bytes"]]
  assert result["payload_bytes"] == pytest.approx(result["payload_MiB"] * 2**20)
  assert result["microbatch_bytes_returned"] == result["microbatch_bytes"] > 0
  assert result["read_vs_memcpy"] == pytest.approx(result["memcpy_s"] / result["read_s"])
  assert result["read_MBps"] == pytest.approx(result["payload_MiB"] / result["read_s"])
  assert result["payload_MiB"] >= 2 and result["with_payload_checksum"]["payload_checksum"]
  # Every payload byte is written at least once; chunk rewrites add a bounded amount.
  assert 1 <= result["write_amplification"] < 10
  assert 1 <= result["with_payload_checksum"]["write_amplification"] < 20
  assert "read / memcpy" in proc.stdout and "append / np.save" in proc.stdout
  images = result["images"]
  assert images["dedup"]["image_copies"] == 4 and images["no_dedup"]["image_copies"] == 16
  for layout in ("dedup", "no_dedup"):
    assert images[layout]["put_s"] > 0 and images[layout]["read_s"] > 0
  # 8 trajectories of 2 groups: 2 images read with dedup, 8 copies without; 4x on disk.
  image = 256 * 256 * 3 * 4
  assert images["no_dedup"]["read_moved_MB"] - images["dedup"]["read_moved_MB"] == pytest.approx(
      6 * image / 1e6)
  assert images["no_dedup_vs_dedup_image_bytes_on_disk"] == pytest.approx(4, rel=0.05)
  assert "image bytes on disk" in proc.stdout


def test_bench_image_hash_writes_its_json(tmp_path):
  out = tmp_path / "hash.json"
  proc = subprocess.run([sys.executable, "scripts/bench_image_hash.py", "--json", str(out),
                         "--mb", "0.1", "--reps", "3"], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  for name in ("blake2b_128", "xxh3_128", "image_id", "memcpy"):
    assert result["MBps"][name] > 0 and result["ms_per_image"][name] > 0, name
  assert result["image_MB"] == pytest.approx(0.1) and "xxh3_128" in proc.stdout
  # The functions timed are the ones named, on the image's bytes: their outputs are
  # the reference libraries' on the same array, and the copy is a copy.
  import hashlib
  import zlib

  import numpy as np
  import xxhash
  from knittrans_jax.storage import image_id
  data = np.random.default_rng(result["seed"]).integers(0, 256, 100_000, dtype=np.uint8)
  d = result["digests"]
  assert d["blake2b_128"] == hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
  assert d["xxh3_128"] == xxhash.xxh3_128(data.tobytes()).hexdigest()
  assert d["crc32"] == str(zlib.crc32(data.tobytes())) and d["image_id"] == image_id(data)
  assert result["memcpy_equal"] is True


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


def test_simulate_script_writes_summary(tmp_path):
  out = tmp_path / "sim"
  proc = subprocess.run([sys.executable, "scripts/simulate.py", "--gin_file", "configs/sim/tiny.gin",
                         "--out", str(out), "--seeds", "0,1"], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  s = json.loads((out / "summary.json").read_text())
  for name in ("train_batch", "fifo", "constraint_preserving"):
    p = s["policies"][name]
    for key in ("window", "arch_staleness_mean", "arch_staleness_signed_mean", "arch_staleness_p99",
                "arch_staleness_max", "quota_violations", "throughput_traj_per_s"):
      assert key in p, (name, key)
  assert s["policies"]["train_batch"]["window"] == 64
  assert s["policies"]["constraint_preserving"]["quota_violations"] == 0
  assert s["policies"]["fifo"]["quota_violations"] > 0
  assert s["policies"]["constraint_preserving"]["throughput_traj_per_s"] >= s["baseline_throughput_traj_per_s"]
  assert -1 < s["reduction_vs_train_batch"] <= 1 and s["wall_s"] > 0
  assert (out / "frontier.json").exists() and (out / "operative_config.gin").exists()
  # The baseline at three windows; the 2G one is the headline; over both seeds.
  by = s["reduction_by_baseline_window"]
  assert [by[k]["window"] for k in ("1G", "2G", "4G")] == [32, 64, 128]
  assert by["2G"]["reduction"] == s["reduction_vs_train_batch"]
  assert all(-1 < by[k]["reduction"] <= 1 for k in by)
  seeds = s["reduction_by_baseline_window_over_seeds"]
  assert s["seeds"] == [0, 1] and set(seeds) == set(by)
  for k, r in seeds.items():
    assert set(r["by_seed"]) == {"0", "1"} and r["by_seed"]["0"] == by[k]["reduction"]
    assert r["min"] <= r["mean"] <= r["max"] and r["min"] < r["max"]  # seed 1 is another run
  # The per-run counterfactual is named for what it is.
  assert "counterfactual_reduction" in s and "decode_floor_reduction" not in s
  # The policy-independent bound: no policy reduces more than it allows, on either seed.
  assert 0 < s["bound"] < s["policies"]["train_batch"]["arch_staleness_mean"]
  assert s["runs_below_bound"] == {"0": [], "1": []}
  for k, r in by.items():
    assert r["reduction"] <= r["bound_reduction"] <= 1
    assert r["bound_reduction"] == seeds[k]["bound_reduction"]["by_seed"]["0"]
  assert 0 < s["fraction_of_bound"] <= 1


def script(name: str):
  """scripts/<name>.py as a module (its main runs in this process: no interpreter and
  JAX start for a check that needs no job)."""
  return load_script(name)


def figures(group: str):
  """scripts/reproduce_figures.py's figure group `group` (scripts/figures_<group>.py)."""
  sys.path.insert(0, "scripts")
  return importlib.import_module(f"figures_{group}")


@pytest.mark.slow
def test_reproduce_figures_staleness(tmp_path):
  out = tmp_path / "figs"
  proc = subprocess.run([sys.executable, "scripts/reproduce_figures.py", "--only", "staleness",
                         "--gin_file", "configs/sim/tiny.gin", "--sensitivity_batches", "3",
                         "--out", str(out)], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ("staleness_frontier.png", "staleness_cdf.png", "staleness_sensitivity.png",
               "summary.md", "numbers.json"):
    assert (out / name).stat().st_size > 0, name
  text = (out / "summary.md").read_text()
  assert "Reduction vs train_batch" in text and "Policy-independent bound" in text
  st = json.loads((out / "numbers.json").read_text())["staleness"]
  assert set(st["reduction_by_baseline_window"]) == {"1G", "2G", "4G"} and st["seeds"] == [0, 1, 2, 3, 4]
  assert all(r["reduction"] <= r["bound_reduction"] for r in st["reduction_by_baseline_window"].values())
  assert st["runs_below_bound"] == {str(k): [] for k in range(5)}
  assert "| W = 4G = 128 |" in text


def test_reproduce_figures_peers_quick(tmp_path):
  """--quick draws the peers figure: every peer rule beside ours on both workloads
  (the simulator; tiny.gin for paper_text here), with what each gives up."""
  out = tmp_path / "figs"
  proc = subprocess.run([sys.executable, "scripts/reproduce_figures.py", "--quick", "--only",
                         "peers", "--gin_file", "configs/sim/tiny.gin", "--out", str(out),
                         "--work", str(tmp_path / "work")], capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ("peers_paper_text.png", "peers_agentic.png"):
    assert (out / name).stat().st_size > 0, name
  assert "## Against the peers' rules" in (out / "summary.md").read_text()
  peers = json.loads((out / "numbers.json").read_text())["peers"]
  for workload in ("paper_text", "agentic"):
    rules = peers[workload]["rules"]
    assert {"areal", "verl", "nemo_weight_fifo", "nemo_windowed", "prime_rl",
            "tinker_discard"} <= set(rules)
    for name, r in rules.items():
      ran = [f for f in r["frontier"] if not f.get("stalled")]
      assert ran and all(f["traj_per_s"] > 0 for f in ran), name
      assert r["quota_error"]["max"] >= r["quota_error"]["mean"] >= 0
      if name.startswith("constraint_preserving"):
        assert r["quota_error"]["max"] == 0.0 and r["matched_reduction"] is None
      else:
        m = r["matched_reduction"]
        assert m["mean"] is not None or m["reason"], name
    # Discarding stale groups trains the slow problems less often (tinker PR #822's point).
    assert rules["tinker_discard"]["tail_bias"]["slowest_decile_trained_share_mean"] < 1
    assert rules["areal"]["tail_bias"]["slowest_decile_trained_share_min"] == 1.0
  assert "real_job" in peers["agentic"]  # no real_peers JSON in --work: said so


@pytest.mark.slow
def test_bench_train_step_writes_its_json(tmp_path):
  out = tmp_path / "train.json"
  env = dict(__import__("os").environ, JAX_PLATFORMS="cpu")  # the suite's 8 devices, fast compiles
  proc = subprocess.run([sys.executable, "scripts/bench_train_step.py", "--json", str(out),
                         "--layouts", "dp", "--seq", "32", "--batch", "8", "--micro_batches", "2",
                         "--reps", "1"], capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())["layouts"]["dp"]
  assert r["tokens_per_s"] > 0 and r["micro_step_tokens_per_s"] > 0 and r["mesh"] == {"data": 8}


@pytest.mark.slow
def test_bench_train_step_packing_writes_its_json(tmp_path):
  out = tmp_path / "packing.json"
  env = dict(__import__("os").environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
  proc = subprocess.run([sys.executable, "scripts/bench_train_step.py", "--packing", "--json",
                         str(out), "--groups", "3", "--batch", "4", "--reps", "1"],
                        capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name, r in json.loads(out.read_text())["packing"].items():
    assert r["trajectories"] == 24 and r["packed"]["computed_tokens"] < r["padded"]["computed_tokens"]
    assert r["padding_fraction"] == r["packed"]["padding_fraction"] < r["padded"]["padding_fraction"]
    assert r["speedup"] > 0, name


@pytest.mark.slow
def test_bench_multimodal_writes_its_json(tmp_path):
  out = tmp_path / "mm.json"
  proc = subprocess.run([sys.executable, "scripts/bench_multimodal.py", "--json", str(out),
                         "--image", "56", "--prompts", "4", "--n", "4", "--micro", "8",
                         "--mini_batches", "1", "--seq", "16", "--vit_width", "32",
                         "--lm_width", "32"], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  for key in ("baseline_s", "knittrans_s"):
    assert r[key] > 0, key
  assert r["speedup"] == pytest.approx(r["baseline_s"] / r["knittrans_s"])
  assert r["ablation"]["dedup_only_s"] > 0 and r["ablation"]["ondemand_only_s"] > 0
  assert r["grad_max_rel_err"] <= 1e-5
  # 4 prompts x n = 4 over 2 consumers (2 whole groups each): 16 images through the
  # naive encoder, 4 (one per unique image) through the encode-once step.
  assert r["encoder_forwards"] == {"baseline": 16, "knittrans": 4, "unique_images": 4}
  assert "speedup" in proc.stdout
  fig = figures("multimodal").multimodal_figure(r, str(tmp_path))
  assert fig["seconds_per_mini_batch"]["dedup_only"] == r["ablation"]["dedup_only_s"]
  assert fig["seconds_per_mini_batch"]["knittrans"] == r["knittrans_s"]
  assert (tmp_path / "multimodal_step.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_throughput_interleaves_and_reads_the_steady_state(tmp_path, monkeypatch, capsys):
  out = tmp_path / "throughput.json"
  proc = subprocess.run([sys.executable, "scripts/bench_throughput.py", "--gin_file",
                         "configs/text_grpo_test.gin", "--config",
                         "tb: JobConfig.policy = 'train_batch'; JobConfig.window = 8",
                         "--config", "cp: JobConfig.policy = 'constraint_preserving'",
                         "--repeats", "2", "--train_batches", "2", "--skip_train_batches", "1",
                         "--json", str(out)], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert list(r["configurations"]) == ["tb", "cp"] and r["skipped_steps"] > 0
  for c in r["configurations"].values():
    x = [run["traj_per_s"] for run in c["runs"]]
    assert len(x) == 2 and all(v > 0 for v in x)
    # The engine's behaviour log-probs against the trainer's (the JAX engine: equal).
    assert all(0 <= run["logprob_abs_diff_mean"] <= run["logprob_abs_diff_max"] < 1e-3
               for run in c["runs"])
    assert c["traj_per_s_min"] == min(x) <= c["traj_per_s_mean"] <= max(x) == c["traj_per_s_max"]
  # The two settings give different staleness: the bindings reached the runs.
  assert r["configurations"]["tb"]["runs"][0]["arch_staleness_mean"] != \
      r["configurations"]["cp"]["runs"][0]["arch_staleness_mean"]
  bench = script("bench_throughput")
  with monkeypatch.context() as m:
    m.setattr(sys, "argv", ["bench_throughput.py", "--gin_file", "configs/text_grpo_test.gin",
                            "--config", "no colon here", "--json", str(out)])
    with pytest.raises(SystemExit) as bad:
      bench.main()
  assert bad.value.code == 2 and "give 'NAME: binding" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_rollout_agentic_writes_its_json(tmp_path):
  """The agentic workload on the JAX engine at toy size (8 groups of 4, short tools):
  every group ends, the group-time distribution, busy fraction and turns are written,
  and the turns follow the workload (one 'nearest' turn, 1-8 'hop' turns)."""
  out = tmp_path / "agentic.json"
  proc = subprocess.run([sys.executable, "scripts/bench_rollout.py", "--workload", "agentic",
                         "--engines", "jax", "--groups", "8", "--in_flight", "4", "--json", str(out),
                         "--gin_bindings", "TrainBatchSpec.group_size = 4",
                         "--gin_bindings", "ToolLatency.median_s = 0.005",
                         # fewer padded shapes to compile: 4 rows a call, contexts <= 40
                         "--gin_bindings", "JobConfig.groups_per_call = 1",
                         "--gin_bindings", "AgentConfig.max_tokens = 40"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.load(open(out))["engines"]["jax"]
  assert r["groups"] == 8 and r["failed_groups"] == 0 and r["in_flight"] == 4
  assert r["compiled_shapes"] > 0 and r["compiled_while_timed"] == 0
  g = r["group_time_s"]
  assert 0 < g["p50"] <= g["p90"] <= g["p99"] and r["p99_over_p50"] == g["p99"] / g["p50"]
  assert 0 < r["engine_utilization"] <= r["busy_fraction"] <= 1
  t = r["turns_per_episode"]
  assert 1 <= t["p50"] <= t["max"] <= 8 and r["response_tokens"] > 0


@pytest.mark.slow
def test_real_staleness_runs_the_job_and_replays_each_run(tmp_path, monkeypatch):
  """scripts/real_staleness.py at toy size: the baselines at G, 2G and 4G and one
  constraint-preserving window, each run replayed by the simulator from its own
  trace.json; --resimulate gives the same replays (seeded)."""
  out = tmp_path / "rs.json"
  proc = subprocess.run([sys.executable, "scripts/real_staleness.py", "--gin_file",
                         "configs/agentic_test.gin", "--seeds", "0", "--train_batches", "2",
                         "--skip_train_batches", "1", "--windows", "2", "--dispatch", "shuffled",
                         "--json", str(out)], capture_output=True, text=True, timeout=600,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert set(r["reduction_by_baseline_window"]) == {"G", "2G", "4G"} and r["G"] == 8
  assert {(x["policy"], x["window"]) for x in r["runs"]} >= {
      ("train_batch", 8), ("train_batch", 16), ("train_batch", 32), ("constraint_preserving", 8)}
  for x in r["runs"]:
    assert x["traj_per_s"] > 0 and x["quota_violations"] == 0 and x["sim"]["traj_per_s"] > 0
    assert (tmp_path / "rs" / os.path.basename(x["workdir"]) / "trace.json").exists()
  assert r["sim_relative_error"]["n"] >= len(r["runs"]) and len(r["frontier"]) == len(r["runs"])
  before = [x["sim"] for x in r["runs"]]
  monkeypatch.setattr(sys, "argv", ["real_staleness.py", "--gin_file", "x", "--json", str(out),
                                    "--resimulate"])
  script("real_staleness").main()
  assert [x["sim"] for x in json.loads(out.read_text())["runs"]] == before


def test_bench_rollout_weights_only_times_both_weight_paths(tmp_path, monkeypatch):
  """--weights_only on a tiny model (--model): the JAX engine's updates through shared
  memory and through the old files, each beside a copy of the same bytes, in one run,
  and the shared-memory segments are gone after it."""
  import glob
  bench = script("bench_rollout")
  out = tmp_path / "weights.json"
  monkeypatch.setattr(sys, "argv", ["bench_rollout.py", "--engines", "jax", "--weights_only",
                                    "--updates", "2", "--model", "configs/models/tiny_qwen2.gin",
                                    "--json", str(out)])
  bench.main()
  r = json.loads(out.read_text())
  jax_ = r["engines"]["jax"]
  # tiny_qwen2 (float32): the tied embedding, 2 blocks (q, k, v with biases, o, two norms,
  # the MLP), the final norm: every parameter once.
  block = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 2 * 64 + 3 * 64 * 128
  assert r["config"]["parameters"] == 512 * 64 + 2 * block + 64
  for w, transport in ((jax_, "shm"), (jax_["old_path"], "files")):
    assert w["transport"] == transport and w["weight_bytes"] == 4 * r["config"]["parameters"]
    assert all(len(w["runs"][k]) == 2
               for k in ("publish_s", "subscribe_s", "load_s", "copy_s", "copy_warm_s"))
  assert not glob.glob(f"/dev/shm/knittrans-*-{os.getpid()}-*")
