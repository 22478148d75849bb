"""The device benchmark's sections (scripts/device_bench.py), each one entry's figures
for one model: train (a packed mini-batch update and its MFU), rollout (the JAX
engine), weights (a version through the publisher and subscriber) and h2d (a packed
mini-batch read from a store and put on the devices)."""
from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knittrans_jax.bench.timing import median_of, timed
from knittrans_jax.dataplane.packing import PackLayout
from knittrans_jax.job.batching import build_packed_batch
from knittrans_jax.job.work import StepPlanner
from knittrans_jax.models import DecoderLM
from knittrans_jax.models.flops import matmul_params, mfu_fields, train_flops
from knittrans_jax.rl import LossConfig
from knittrans_jax.rollout.engine import EngineSpec, GroupRequest, PromptSpec, response_seeds
from knittrans_jax.rollout.engines import make_engine
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.rollout.weight_subscriber import WeightSubscriber
from knittrans_jax.rollout.weights import WeightPublisher, WeightSyncConfig, wire_template
from knittrans_jax.storage import StoreSchema, TrajectoryStore
from knittrans_jax.storage.synthetic import random_group
from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, batch_shardings,
                                 init_train_state, make_mesh, make_optimizer, put_batch)
from knittrans_jax.train.batch import rows_multiple
from knittrans_jax.types import GroupInfo, MiniBatch, Payload, TrajMeta


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



@dataclasses.dataclass(frozen=True)
class EntryConfigs:
  """The gin-bound configs an entry runs with, built by the caller (the gin root) once
  the entry's model file is parsed."""
  mesh: MeshConfig
  optimizer: OptimizerConfig
  loss: LossConfig
  weights: WeightSyncConfig
  sampler: SamplerConfig


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


def bench_train(cfg, sizes: Sizes, peak: dict, budget_s: float, configs: EntryConfigs,
                deadline: float = math.inf) -> dict:
  mesh_cfg = configs.mesh
  mesh = make_mesh(mesh_cfg)
  tx = make_optimizer(configs.optimizer)
  graphdef, state, shardings = init_train_state(lambda r: DecoderLM(cfg, r), tx, mesh,
                                                mesh_cfg.rules)
  fns = StepFunctions(graphdef, shardings, tx, configs.loss, mesh, mesh_cfg.rules)
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

  t = timed(update, sizes.reps, budget_s, "train reps", deadline)
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


def bench_rollout(cfg, sizes: Sizes, budget_s: float, deadline: float = math.inf) -> dict:
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
    t = timed(call, sizes.reps, budget_s, "rollout reps", deadline)
  finally:
    engine.close()
  tokens_per_s = [e["tokens"] / e["wall_s"] for e in t["extras"]]
  return {"groups": G, "n": n, "rows": G * n, "prompt_len": sizes.rollout_prompt_len,
          "max_new_tokens": sizes.max_new_tokens,
          "tokens_per_call": median_of(t["extras"], "tokens"),
          "call_s": median_of(t["extras"], "wall_s"),
          "tokens_per_s": float(statistics.median(tokens_per_s)), "weights_dtype": cfg.dtype,
          "warmup_s": t["warmup_s"], "compile_s": t["compile_s"], "runs_s": t["runs_s"]}


def bench_weights(cfg, sizes: Sizes, budget_s: float, workdir: str, configs: EntryConfigs,
                  deadline: float = math.inf) -> dict:
  graphdef, params = random_params(cfg)  # the trainer's float32 master weights, on device
  sync = configs.weights
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
      engine = make_engine(EngineSpec("jax", cfg, configs.sampler, 0, groups_per_call=1),
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
    t = timed(update, sizes.reps, budget_s, "weight versions", deadline)
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


def bench_h2d(cfg, sizes: Sizes, budget_s: float, workdir: str, configs: EntryConfigs,
              deadline: float = math.inf) -> dict:
  mesh_cfg = configs.mesh
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

    t = timed(read_and_put, max(sizes.reps, 5), budget_s, "h2d reps", deadline)
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

