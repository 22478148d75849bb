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
import statistics
import sys
import tempfile
import time
import traceback

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

# Every configurable registered before the first gin parse (gin then locks).
from knittrans_jax import cli
from knittrans_jax.models.flops import matmul_params, mfu_fields, peak_flops, train_flops
from knittrans_jax.dataplane.packing import PackLayout
from knittrans_jax.job.batching import build_packed_batch
from knittrans_jax.job.work import StepPlanner
from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.models.decoder import REMAT_POLICIES
from knittrans_jax.models.layers import ATTENTION_IMPLS
from knittrans_jax.rl import LossConfig
from knittrans_jax.rollout.engine import (EngineSpec, GroupRequest, PromptSpec,
                                          response_seeds)
from knittrans_jax.rollout.engines import make_engine
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.rollout.weight_subscriber import WeightSubscriber
from knittrans_jax.rollout.weights import WeightPublisher, WeightSyncConfig, wire_template
from knittrans_jax.storage import StoreSchema, TrajectoryStore
from knittrans_jax.storage.synthetic import random_group
from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions,
                                 batch_shardings, init_train_state, make_mesh, make_optimizer,
                                 put_batch)
from knittrans_jax.train.batch import rows_multiple
from knittrans_jax.types import GroupInfo, MiniBatch, Payload, TrajMeta

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


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The workload. Train and h2d: `groups` groups of `n` trajectories, prompts of
  `prompt_len`, lognormal responses (median `response_median`, at most
  `response_max`), packed into rows of `seq_len` tokens, `rows` rows a micro-batch at
  most. Rollout: `rollout_groups` groups of `n`, `max_new_tokens` each."""
  groups: int
  n: int
  prompt_len: int
  response_median: int
  response_max: int
  seq_len: int
  rows: int
  rollout_groups: int
  rollout_prompt_len: int
  max_new_tokens: int
  reps: int


FULL = Sizes(groups=16, n=8, prompt_len=256, response_median=512, response_max=1536,
             seq_len=2048, rows=8, rollout_groups=16, rollout_prompt_len=256,
             max_new_tokens=512, reps=3)
DRY = Sizes(groups=2, n=4, prompt_len=8, response_median=16, response_max=40, seq_len=64,
            rows=8, rollout_groups=2, rollout_prompt_len=8, max_new_tokens=8, reps=2)


# -- timing -------------------------------------------------------------------------------
# The run's end (time.perf_counter()): no timed rep starts that would end after it.
DEADLINE = [math.inf]


def timed(fn, reps: int, budget_s: float, desc: str) -> dict:
  """One warm-up call (compilation), then up to `reps` timed calls while the entry's
  budget and the run's DEADLINE last (one at least). fn() returns None or a dict of
  per-call figures."""
  t0 = time.perf_counter()
  fn()
  warmup = time.perf_counter() - t0
  times, extras = [], []
  end = min(time.perf_counter() + budget_s, DEADLINE[0])
  for _ in tqdm(range(reps), desc=desc, unit="rep", leave=False):
    t = time.perf_counter()
    extras.append(fn())
    times.append(time.perf_counter() - t)
    if time.perf_counter() + times[-1] > end:  # the next rep would overrun
      break
  med = statistics.median(times)
  return {"median_s": med, "runs_s": times, "warmup_s": warmup,
          "compile_s": max(warmup - med, 0.0), "extras": extras}


def median_of(extras: list[dict], key: str) -> float:
  return float(statistics.median(e[key] for e in extras))


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


def random_params(cfg, seed: int = 0):
  """(graphdef, params): a randomly initialised decoder on the default device."""
  with nnx.use_eager_sharding(False):
    model = DecoderLM(cfg, nnx.Rngs(seed))
  return nnx.split(model, nnx.Param)


def wire_cast(params, dtype):
  """The leaves as an engine gets them (WeightSyncConfig dtype 'engine')."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      params)


def response_lengths(rng, sizes: Sizes, count: int) -> np.ndarray:
  """Lognormal response lengths, as storage/synthetic.random_group draws them."""
  return np.clip(rng.lognormal(np.log(sizes.response_median), 0.6, count), 1,
                 sizes.response_max).astype(int)


def packed_plan(metas, sizes: Sizes, unit: int):
  """The job's packed StepWork for one mini-batch of `metas` (groups of n, in order)."""
  n = sizes.n
  groups = tuple(GroupInfo.from_metas(metas[g * n:(g + 1) * n]) for g in range(len(metas) // n))
  rows = unit * math.ceil(sizes.rows / unit)
  return StepPlanner(1, rows, pack=PackLayout(sizes.seq_len, rows, unit))(
      MiniBatch(0, 0, groups, 0)), rows


# -- sections -----------------------------------------------------------------------------
def bench_train(cfg, sizes: Sizes, peak: dict, budget_s: float) -> dict:

  mesh_cfg = MeshConfig()
  mesh = make_mesh(mesh_cfg)
  tx = make_optimizer(OptimizerConfig())
  graphdef, state, shardings = init_train_state(lambda r: DecoderLM(cfg, r), tx, mesh,
                                                mesh_cfg.rules)
  fns = StepFunctions(graphdef, shardings, tx, LossConfig(), mesh, mesh_cfg.rules)
  total = int(sum(x.size for x in jax.tree.leaves(state.params)))
  rng = np.random.default_rng(0)
  count = sizes.groups * sizes.n
  P = sizes.prompt_len
  metas, data = [], {}
  for i, R in enumerate(response_lengths(rng, sizes, count)):
    m = TrajMeta("u", i, 0, P, int(R), "s", i // sizes.n, i % sizes.n, 0, 0,
                 float(rng.random()), loss_tokens=int(R))
    mask = (np.arange(P + R) >= P).astype(np.uint8)
    metas.append(m)
    data[m.id] = (rng.integers(2, cfg.vocab_size, P + R).astype(np.int32),
                  np.where(mask, -np.log(cfg.vocab_size), 0).astype(np.float32), mask)
  work, rows = packed_plan(metas, sizes, rows_multiple(mesh, mesh_cfg.rules))
  micros = []
  for k, ms in enumerate(work.local_micro_batches([0])):
    payload = Payload(list(ms), *[[data[m.id][j] for m in ms] for j in range(3)], {})
    rows_k, row_of = work.local_rows([0], k)
    batch = build_packed_batch(payload, work.advantages, row_of, sizes.seq_len, rows_k)
    micros.append(put_batch(batch, batch_shardings(mesh, mesh_cfg.rules, batch)))
  lengths = [m.length for m in metas]
  n_total = float(work.total_tokens)

  def update():
    nonlocal state
    acc, sums = fns.zero_grads(state.params), fns.zero_sums(state, micros[0])
    for m in micros:
      acc, sums = fns.micro_step(state, acc, sums, m, n_total)
    state, metrics = fns.apply_step(state, acc)
    jax.block_until_ready((state, metrics, sums))

  t = timed(update, sizes.reps, budget_s, "train reps")
  tokens = int(sum(lengths))
  computed = sum(int(b["tokens"].size) for b in micros)
  n_matmul = matmul_params(cfg, total)
  flops = train_flops(cfg, n_matmul, lengths)
  out = {"params": total, "matmul_params": n_matmul, "trajectories": count, "tokens": tokens,
         "micro_batches": len(micros), "rows": rows, "seq_len": sizes.seq_len,
         "padding_fraction": 1 - tokens / computed, "update_s": t["median_s"],
         "tokens_per_s": tokens / t["median_s"], "flops_per_update": flops,
         "flops_per_token": flops / tokens, "model_flops_per_s": flops / t["median_s"],
         **mfu_fields(flops, t["median_s"], peak, mesh.devices.size),
         "warmup_s": t["warmup_s"], "compile_s": t["compile_s"], "runs_s": t["runs_s"],
         "dtype": cfg.dtype, "param_dtype": cfg.param_dtype, "remat": cfg.remat,
         "attention": cfg.attention, "mesh": {k: int(v) for k, v in mesh.shape.items()}}
  del state, micros
  return out


def bench_rollout(cfg, sizes: Sizes, budget_s: float) -> dict:

  graphdef, params = random_params(cfg)
  params = wire_cast(params, cfg.dtype)  # the engine's weights, as a worker receives them
  sampler = SamplerConfig(max_new_tokens=sizes.max_new_tokens, temperature=1.0, top_p=1.0)
  G, n = sizes.rollout_groups, sizes.n
  spec = EngineSpec("jax", cfg, sampler, 0, groups_per_call=G,
                    prompts=PromptSpec(length=sizes.rollout_prompt_len))
  engine = make_engine(spec, graphdef, params, 0)
  rng = np.random.default_rng(0)
  calls = [0]

  def call():
    start = calls[0] * G  # new groups (prompts, seeds) every call
    calls[0] += 1
    reqs = [GroupRequest(g, "bench", rng.integers(2, cfg.vocab_size, sizes.rollout_prompt_len
                                                  ).astype(np.int32), n, response_seeds(0, g, n))
            for g in range(start, start + G)]
    t = time.perf_counter()
    done = engine.generate(reqs)
    wall = time.perf_counter() - t
    return {"tokens": sum(r.tokens.size for g in done for r in g.responses), "wall_s": wall}

  try:
    t = timed(call, sizes.reps, budget_s, "rollout reps")
  finally:
    engine.close()
  tokens_per_s = [e["tokens"] / e["wall_s"] for e in t["extras"]]
  return {"groups": G, "n": n, "rows": G * n, "prompt_len": sizes.rollout_prompt_len,
          "max_new_tokens": sizes.max_new_tokens,
          "tokens_per_call": median_of(t["extras"], "tokens"),
          "call_s": median_of(t["extras"], "wall_s"),
          "tokens_per_s": float(statistics.median(tokens_per_s)), "weights_dtype": cfg.dtype,
          "warmup_s": t["warmup_s"], "compile_s": t["compile_s"], "runs_s": t["runs_s"]}


def bench_weights(cfg, sizes: Sizes, budget_s: float, workdir: str) -> dict:

  graphdef, params = random_params(cfg)  # the trainer's float32 master weights, on device
  sync = WeightSyncConfig()
  dtype = sync.wire_dtype(cfg)
  sync = sync.resolve("local", sync.wire_bytes(params, cfg))
  tmp = tempfile.mkdtemp(prefix="device_bench_weights_", dir=workdir)
  pub = WeightPublisher(tmp, sync=sync, dtype=dtype, version=0)
  sub = WeightSubscriber(tmp, wire_template(params, dtype), verify=sync.verify)
  engine, version = None, [0]

  def update():
    nonlocal engine
    version[0] += 1
    v = version[0]
    t0 = time.perf_counter()
    pub.write_part(v, params)
    pub.commit(v)
    t1 = time.perf_counter()
    got = sub.poll()
    t2 = time.perf_counter()
    if got is None:
      raise RuntimeError(f"weights v{v}: published, but the subscriber found no new version")
    if engine is None:  # the warm-up: the engine starts on the first version
      engine = make_engine(EngineSpec("jax", cfg, SamplerConfig(), 0, groups_per_call=1),
                           graphdef, got[1], got[0])
    engine.update_weights(*got)
    jax.block_until_ready(engine.params)
    t3 = time.perf_counter()
    leaves = jax.tree.leaves(got[1])
    nbytes = sum(x.nbytes for x in leaves)
    t4 = time.perf_counter()
    copies = [np.array(x, copy=True) for x in leaves]  # the memcpy of the same bytes
    copy = time.perf_counter() - t4
    del copies, leaves, got
    return {"publish_s": t1 - t0, "subscribe_s": t2 - t1, "load_s": t3 - t2,
            "per_version_s": t3 - t0, "copy_s": copy, "bytes": nbytes}

  try:
    t = timed(update, sizes.reps, budget_s, "weight versions")
  finally:
    pub.close()
    if engine is not None:
      engine.close()
    shutil.rmtree(tmp, ignore_errors=True)
  ex = t["extras"]
  out = {"transport": sync.transport, "weight_dtype": str(dtype or "as trained"),
         "weight_bytes": int(ex[0]["bytes"]),
         **{k: median_of(ex, k) for k in ("per_version_s", "publish_s", "subscribe_s", "load_s",
                                          "copy_s")}}
  out.update(publish_bytes_per_s=out["weight_bytes"] / out["publish_s"],
             per_version_vs_copy=out["per_version_s"] / max(out["copy_s"], 1e-12),
             warmup_s=t["warmup_s"], compile_s=t["compile_s"],
             runs={k: [e[k] for e in ex] for k in ("per_version_s", "publish_s", "subscribe_s",
                                                   "load_s", "copy_s")})
  return out


def bench_h2d(cfg, sizes: Sizes, budget_s: float, workdir: str) -> dict:

  mesh_cfg = MeshConfig()
  mesh = make_mesh(mesh_cfg)
  tmp = tempfile.mkdtemp(prefix="device_bench_store_", dir=workdir)
  try:
    store = TrajectoryStore.create(f"file://{tmp}", StoreSchema(sources=("math",)))
    writer = store.writer("bench")
    rng = np.random.default_rng(0)
    metas = []
    for g in range(sizes.groups):
      metas += writer.append(random_group(
          rng, g, sizes.n, "math", prompt_len=sizes.prompt_len,
          response_len_median=sizes.response_median, max_response_len=sizes.response_max,
          vocab=cfg.vocab_size))
    work, rows = packed_plan(metas, sizes, rows_multiple(mesh, mesh_cfg.rules))
    shardings = {}

    def read_and_put():
      read = build = put = 0.0
      payload_bytes = batch_bytes = 0
      for k, ms in enumerate(work.local_micro_batches([0])):
        t0 = time.perf_counter()
        payload = store.read(ms).result()
        t1 = time.perf_counter()
        rows_k, row_of = work.local_rows([0], k)
        batch = build_packed_batch(payload, work.advantages, row_of, sizes.seq_len, rows_k)
        t2 = time.perf_counter()
        if rows_k not in shardings:
          shardings[rows_k] = batch_shardings(mesh, mesh_cfg.rules, batch)
        jax.block_until_ready(put_batch(batch, shardings[rows_k]))
        t3 = time.perf_counter()
        read, build, put = read + t1 - t0, build + t2 - t1, put + t3 - t2
        payload_bytes += sum(a.nbytes for part in (payload.tokens, payload.logprobs,
                                                   payload.loss_mask) for a in part)
        batch_bytes += sum(a.nbytes for a in batch.values())
      return {"read_s": read, "build_s": build, "put_s": put, "total_s": read + build + put,
              "payload_bytes": payload_bytes, "batch_bytes": batch_bytes}

    t = timed(read_and_put, max(sizes.reps, 5), budget_s, "h2d reps")
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  ex = t["extras"]
  out = {"trajectories": len(metas), "micro_batches": work.num_micro_batches, "rows": rows,
         "seq_len": sizes.seq_len, "payload_bytes": int(ex[0]["payload_bytes"]),
         "batch_bytes": int(ex[0]["batch_bytes"]),
         **{k: median_of(ex, k) for k in ("read_s", "build_s", "put_s", "total_s")}}
  out.update(h2d_bytes_per_s=out["batch_bytes"] / out["put_s"],
             read_bytes_per_s=out["payload_bytes"] / out["read_s"],
             end_to_end_bytes_per_s=out["batch_bytes"] / out["total_s"],
             warmup_s=t["warmup_s"], runs_s=t["runs_s"],
             mesh={k: int(v) for k, v in mesh.shape.items()})
  return out


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
  DEADLINE[0] = t_run + args.budget_s
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
        budget = BUDGET_S[section] / (10 if args.dry_run else 1)
        if section == "train":
          result = bench_train(cfg, sizes, peak, budget)
        elif section == "rollout":
          result = bench_rollout(cfg, sizes, budget)
        elif section == "weights":
          result = bench_weights(cfg, sizes, budget, workdir)
        else:
          result = bench_h2d(cfg, sizes, budget, workdir)
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
