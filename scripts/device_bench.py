"""A ready device benchmark: one command, one accelerator, about 8 minutes, one JSON.

  python scripts/device_bench.py --json runs/device_bench.json
  python scripts/device_bench.py --dry_run --json /tmp/device_bench_dry.json   # toy, CPU

Sections (`--sections`, default all), each model of `--models` (default
configs/models/qwen2_5_0_5b.gin and qwen2_5_1_5b.gin, random weights, bfloat16 compute
over float32 master weights, every block rematerialised, `--attention` 'auto' as
configs/math_grpo_hf.gin runs real models):
  train    tokens/s of one mini-batch update (every micro step of a packed mini-batch,
           JobConfig.packing / dataplane/packing.py, then the optimizer step; the
           micro-batches already on the devices: the h2d section times their way
           there), and its model FLOPs utilisation (below).
  rollout  the JAX engine (rollout/jax_engine.py), every group in one sampler call:
           sampled tokens over the call's wall time (bench_rollout.py's 'jax_static').
  weights  seconds per weight version through the public WeightPublisher /
           WeightSubscriber (rollout/weights.py, the job's transport as
           WeightSyncConfig resolves it for a local run, the engine's dtype): the
           publish from the trainer's device arrays (write_part + commit), one
           worker's poll, the engine's update_weights; beside the bytes and a numpy
           copy of the same bytes.
  h2d      the on-demand read: a packed mini-batch read from a TrajectoryStore (a
           file:// store in --workdir), built into the step's arrays and put on the
           devices with the trainer's batch sharding (train.put_batch); bytes/s of
           the device put alone, of the read and of the whole way.

Every figure is the median of `--reps` timed repetitions after a warm-up (compilation
excluded; each entry's warm-up time, compilation included, is `warmup_s` and
`compile_s` = warm-up - median rep estimates the compilation; with a persistent
compilation cache, `config.compilation_cache`, it is the cache's load time). Entries
run cheap first (RUN_ORDER); each stops its reps at its budget (BUDGET_S) or at
`--budget_s` into the run (one timed rep at least), and one that would start after
`--budget_s` is skipped (named so in the JSON): with the default 360 s, the last
entry's compilation and the process start, the run fits 8 minutes on one GPU. Each
entry's seconds are printed and in `entry_s`. An entry that fails records its error
and the run goes on (the exit status is then 1).

Model FLOPs utilisation (MFU) = model FLOPs per update / update seconds / (peak FLOP/s
of one device x devices). Model FLOPs of an update (PaLM's appendix B, attention
counted causally within each packed trajectory, rematerialisation not counted):
    6 * N * tokens + sum over trajectories of 6 * layers * heads * head_dim * L * (L + 1)
N: the parameters that multiply activations (every parameter but a separate input
embedding table; a tied table counts once, as the output head), tokens: the
trajectories' tokens (padding not counted), L: a trajectory's length. The first term
is 2 FLOPs per parameter per token forward and 4 backward; the second is QK^T and
AV (2 * 2 * heads * head_dim per query-key pair forward, 3x with the backward) over
the L (L + 1) / 2 causal pairs. Peak dense bf16 FLOP/s by jax.devices()[0].device_kind:
PEAK_FLOPS (knittrans_jax/models/flops.py, vendor spec sheets); `--peak_flops` overrides; on a device the table does
not know, MFU is null with the reason.

`--dry_run`: the same code at toy size on CPU (each model file's shape shrunk to a tiny
DecoderConfig, a few tokens, two reps), in well under a minute; tests/test_device_bench.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback

import gin
import jax
from tqdm import tqdm

# Every configurable registered before the first gin parse (gin then locks).
from knittrans_jax import cli
from knittrans_jax.bench.device_sections import (EntryConfigs, Sizes, bench_h2d, bench_rollout,
                                                 bench_train, bench_weights)
from knittrans_jax.models import DecoderConfig
from knittrans_jax.models.decoder import REMAT_POLICIES
from knittrans_jax.models.flops import peak_flops
from knittrans_jax.models.layers import ATTENTION_IMPLS
from knittrans_jax.rl import LossConfig
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.rollout.weights import WeightSyncConfig
from knittrans_jax.train import MeshConfig, OptimizerConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SECTIONS = ("train", "rollout", "weights", "h2d")
# The order entries run in: the cheap ones first (no large compilation), so that a slow
# compile late in the run costs the fewest figures.
RUN_ORDER = ("h2d", "weights", "train", "rollout")
MODELS = ("configs/models/qwen2_5_0_5b.gin", "configs/models/qwen2_5_1_5b.gin")
# Seconds of timed reps per entry (a model's train, rollout, weights; the one h2d):
# with compilation (~1 min a model on one GPU) the run fits 8 minutes.
BUDGET_S = {"train": 60.0, "rollout": 45.0, "weights": 40.0, "h2d": 20.0}
# Dry run: each model file's family and options at this shape.
TOY = dict(vocab_size=512, width=64, depth=2, heads=4, kv_heads=2, head_dim=16, mlp_width=128)
FULL = Sizes(groups=16, n=8, prompt_len=256, response_median=512, response_max=1536,
             seq_len=2048, rows=8, rollout_groups=16, rollout_prompt_len=256,
             max_new_tokens=512, reps=3)
DRY = Sizes(groups=2, n=4, prompt_len=8, response_median=16, response_max=40, seq_len=64,
            rows=8, rollout_groups=2, rollout_prompt_len=8, max_new_tokens=8, reps=2)


# -- models -------------------------------------------------------------------------------
def model_config(path: str, args):
  """The DecoderConfig of a model file, bfloat16 over float32 master weights (toy-sized
  with --dry_run); the dp mesh config parsed beside it."""
  gin.clear_config()
  gin.parse_config_files_and_bindings([os.path.join(REPO, "configs", "mesh", "dp.gin"), path], [])
  cfg = dataclasses.replace(DecoderConfig(), dtype="bfloat16", param_dtype="float32",
                            remat=args.remat, attention=args.attention)
  return dataclasses.replace(cfg, **TOY) if args.dry_run else cfg


def check_models(names: list[str], paths: list[str]) -> None:
  """Every --models file exists and parses (before anything long runs)."""
  cli.register_configurables()  # a model file may bind any of the package's configurables
  for name, path in zip(names, paths):
    if not os.path.isfile(path):
      raise SystemExit(f"device_bench.py: --models: no model config file {name!r} "
                       f"(e.g. {MODELS[0]})")
    try:
      gin.clear_config()
      gin.parse_config_file(path)
      DecoderConfig()
      bound = gin.get_bindings("DecoderConfig")
    except Exception as e:  # gin's own errors name the binding
      raise SystemExit(f"device_bench.py: --models: {name!r} is not a model config: "
                       f"{type(e).__name__}: {e}") from None
    if not bound:  # e.g. a mesh file: the run would measure the default toy decoder
      raise SystemExit(f"device_bench.py: --models: {name!r} binds no DecoderConfig "
                       "(a model config is one of configs/models/*.gin)")
  gin.clear_config()



# -- the run ------------------------------------------------------------------------------
def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", default="runs/device_bench.json")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma list of {', '.join(SECTIONS)}")
  parser.add_argument("--models", default=",".join(MODELS), help="comma list of model gin files")
  parser.add_argument("--peak_flops", type=float, default=None,
                      help="peak FLOP/s of one device (default: PEAK_FLOPS by device kind)")
  parser.add_argument("--budget_s", type=float, default=360.0,
                      help="no entry starts, and no timed rep ends, after this many seconds "
                      "of the run (an entry's warm-up and first rep may go past it)")
  parser.add_argument("--reps", type=int, default=None, help="timed reps an entry (default 3)")
  parser.add_argument("--rows", type=int, default=None,
                      help="packed rows a train micro-batch at most (default 8 of 2048 tokens: "
                      "about 50 GB of one device's memory at 1.5B, by XLA's CPU estimate)")
  parser.add_argument("--attention", default="auto", help="DecoderConfig.attention")
  parser.add_argument("--remat", default="full", help="DecoderConfig.remat")
  parser.add_argument("--workdir", default=None,
                      help="where the store and the 'files' weights go (default: a temp dir)")
  parser.add_argument("--dry_run", action="store_true",
                      help="the same code at toy size on CPU (module doc)")
  cli.add_check_flag(parser)
  args = parser.parse_args(argv)
  args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
  bad = [s for s in args.sections if s not in SECTIONS]
  if bad or not args.sections:
    parser.error(f"--sections: unknown section {bad[0] if bad else args.sections!r}; "
                 f"choose from {', '.join(SECTIONS)}")
  args.models = [m.strip() for m in args.models.split(",") if m.strip()]
  if not args.models:
    parser.error("--models: no model config given")
  stems = [os.path.splitext(os.path.basename(m))[0] for m in args.models]
  if len(set(stems)) < len(stems):  # the JSON keys each model by its file's name
    parser.error(f"--models: {args.models} names a model file twice")
  if args.peak_flops is not None and not (math.isfinite(args.peak_flops) and args.peak_flops > 0):
    parser.error(f"--peak_flops: {args.peak_flops} must be a positive FLOP/s")
  for flag, value in (("--reps", args.reps), ("--rows", args.rows)):
    if value is not None and value < 1:
      parser.error(f"{flag}: {value} must be at least 1")
  for flag, value, allowed in (("--attention", args.attention, ATTENTION_IMPLS),
                               ("--remat", args.remat, tuple(REMAT_POLICIES))):
    if value not in allowed:
      parser.error(f"{flag}: {value!r} is not one of {', '.join(allowed)}")
  args.model_paths = [m if os.path.isabs(m) or os.path.exists(m) else os.path.join(REPO, m)
                      for m in args.models]
  check_models(args.models, args.model_paths)
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if cli.check_only(args):
    return 0
  if args.dry_run:  # before the first backend call: the toy run is the CPU's
    jax.config.update("jax_platforms", "cpu")
  models = args.model_paths
  sizes = DRY if args.dry_run else FULL
  for field in ("reps", "rows"):
    if getattr(args, field) is not None:
      sizes = dataclasses.replace(sizes, **{field: getattr(args, field)})
  workdir = args.workdir or tempfile.mkdtemp(prefix="device_bench_")
  os.makedirs(workdir, exist_ok=True)
  devices = jax.devices()
  kind = devices[0].device_kind
  peak = peak_flops(kind, args.peak_flops)
  out = {"config": {"dry_run": args.dry_run, "sections": args.sections, "models": args.models,
                    "platform": devices[0].platform, "device_kind": kind, "devices": len(devices),
                    "jax": jax.__version__, "sizes": dataclasses.asdict(sizes),
                    "budget_s": args.budget_s, "section_budget_s": BUDGET_S,
                    "compilation_cache": jax.config.jax_compilation_cache_dir or None},
         "peak_flops": peak, **{s: {} for s in args.sections}, "entry_s": {}}
  # Model-free h2d reads the first model's vocabulary once; the others run per model.
  entries = [(s, m) for s in RUN_ORDER if s in args.sections
             for m in (models[:1] if s == "h2d" else models)]
  t_run = time.perf_counter()
  deadline = t_run + args.budget_s  # no timed rep starts that would end after it
  failed = False
  for section, path in tqdm(entries, desc="device_bench", unit="entry"):
    name = os.path.splitext(os.path.basename(path))[0]
    key = section if section == "h2d" else f"{section}/{name}"
    elapsed = time.perf_counter() - t_run
    if elapsed > args.budget_s:
      result = {"skipped": f"the run had spent {elapsed:.0f} s of its --budget_s "
                           f"{args.budget_s:.0f} s before this entry"}
    else:
      t0 = time.perf_counter()
      try:
        cfg = model_config(path, args)
        # The model file's bindings, as the sections would have read them (gin's root).
        configs = EntryConfigs(MeshConfig(), OptimizerConfig(), LossConfig(),
                               WeightSyncConfig(), SamplerConfig())
        budget = BUDGET_S[section] / (10 if args.dry_run else 1)
        if section == "train":
          result = bench_train(cfg, sizes, peak, budget, configs, deadline)
        elif section == "rollout":
          result = bench_rollout(cfg, sizes, budget, deadline)
        elif section == "weights":
          result = bench_weights(cfg, sizes, budget, workdir, configs, deadline)
        else:
          result = bench_h2d(cfg, sizes, budget, workdir, configs, deadline)
      except Exception as e:  # the other entries still run (a later one may fit)
        traceback.print_exc()
        result, failed = {"error": f"{type(e).__name__}: {e}"}, True
      result["section_s"] = time.perf_counter() - t0
      out["entry_s"][key] = result["section_s"]
      tqdm.write(f"{key}: {result['section_s']:.1f} s")
      gin.clear_config()
      jax.clear_caches()  # the entry's executables; its arrays went with its frame
      gc.collect()
    if section == "h2d":
      out["h2d"] = result
    else:
      out[section][name] = result
  out["total_s"] = time.perf_counter() - t_run
  if not args.workdir:
    shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  report(out)
  print(f"wrote {args.json}")
  return 1 if failed else 0


def report(out: dict) -> None:
  c = out["config"]
  print(f"\n{c['devices']} x {c['device_kind']} ({c['platform']}), peak "
        f"{out['peak_flops']['value'] or 'unknown'} FLOP/s, total {out['total_s']:.0f} s")
  for name, r in out.get("train", {}).items():
    if "tokens_per_s" in r:
      mfu = "null" if r["mfu"] is None else f"{r['mfu']:.3f}"
      print(f"  train {name:<14} {r['tokens_per_s']:12.0f} tok/s  MFU {mfu}  update "
            f"{r['update_s']:.3f} s  compile {r['compile_s']:.1f} s")
  for name, r in out.get("rollout", {}).items():
    if "tokens_per_s" in r:
      print(f"  rollout {name:<12} {r['tokens_per_s']:12.0f} tok/s  call {r['call_s']:.3f} s  "
            f"compile {r['compile_s']:.1f} s")
  for name, r in out.get("weights", {}).items():
    if "per_version_s" in r:
      print(f"  weights {name:<12} {r['per_version_s']:.3f} s/version for "
            f"{r['weight_bytes'] / 1e9:.3f} GB ({r['transport']}; publish {r['publish_s']:.3f}, "
            f"subscribe {r['subscribe_s']:.3f}, load {r['load_s']:.3f}, copy {r['copy_s']:.3f})")
  r = out.get("h2d", {})
  if "h2d_bytes_per_s" in r:
    print(f"  h2d {r['batch_bytes'] / 1e6:.2f} MB: put {r['h2d_bytes_per_s'] / 1e9:.2f} GB/s, "
          f"read {r['read_bytes_per_s'] / 1e9:.2f} GB/s, whole way "
          f"{r['end_to_end_bytes_per_s'] / 1e9:.2f} GB/s")
  for key, r in [(f"{s}/{n}", r) for s in SECTIONS if s != "h2d"
                 for n, r in out.get(s, {}).items()] + [("h2d", out.get("h2d", {}))]:
    if "error" in r or "skipped" in r:
      print(f"  {key}: {r.get('error') or r.get('skipped')}")


if __name__ == "__main__":
  sys.exit(main())
