"""Transfer benchmark: centralized baseline vs on-demand reads, side by side.

  python scripts/bench_transfer.py --workload vlm --json runs/bench_transfer_vlm.json
  python scripts/bench_transfer.py --workload text --json runs/bench_transfer_text.json

A real store on disk (file://, 4 producer units) holds a train batch of
--mini_batches x --prompts groups of n = 8 responses (`vlm`: one 448 x 448 x 3
float32 image per prompt, stored once). Each mini-batch is split over
--consumers consumer processes (plan_micro_batches); every consumer runs a fixed
compute per micro-batch: a jitted gradient step of the default decoder on the
micro-batch's tokens (padded or cut to --seq). Then, in the same run:

  baseline   a driver (this process) gathers the whole train batch from the units,
             builds each consumer's slice with the image copied into every
             trajectory, pickles it and sends it through a pipe; the consumer
             unpickles, then computes.
  ondemand   each consumer reads only its own micro-batches from the units with
             the PrefetchingReader (depth --depth), computing while it reads ahead.

exposed_s: time a consumer waited for data after compute could start (the go
signal), summed over its micro-batches; the max over consumers is reported.
raw_transfer_s: time spent moving data for a consumer (baseline: the transfer
phase as the consumer sees it, from the go signal until its slice is unpickled,
plus padding and host-to-device per micro-batch; ondemand: reads + padding +
host-to-device, summed, whether or not it overlapped compute); max over consumers.
bytes_moved: baseline = what the driver read + every pickled slice;
ondemand = what the consumers read.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import numpy as np
from tqdm import tqdm

N = 8
VOCAB = 256  # the default decoder's vocabulary


def build_store(root, workload, mini_batches, prompts, seed=0):
  from knittrans_jax.storage import StoreSchema, TrajectoryStore, image_id
  from knittrans_jax.types import GroupInfo, MiniBatch, Trajectory
  rng = np.random.default_rng(seed)
  store = TrajectoryStore.create("file://" + root, StoreSchema(
      sources=("text", "vqa"), max_prompt_len=4096, max_response_len=8192))
  writers = [store.writer(f"producer{p}", host=f"host{p % 2}") for p in range(4)]
  batches = []
  for k in range(mini_batches):
    groups = []
    for g in range(prompts):
      gid = k * prompts + g
      w = writers[gid % len(writers)]
      images, ids = [], ()
      if workload == "vlm":
        img = rng.random((448, 448, 3), dtype=np.float32)
        images, ids = [img], (image_id(img),)
        P, median = 64, 256
      else:
        P, median = 256, 1024
      prompt = rng.integers(0, VOCAB, P, dtype=np.int32)
      trajs = []
      for i in range(N):
        R = int(np.clip(rng.lognormal(np.log(median), 0.5), 16, 4096))
        trajs.append(Trajectory(prompt_tokens=prompt,
                                response_tokens=rng.integers(0, VOCAB, R, dtype=np.int32),
                                logprobs=-rng.random(R, dtype=np.float32),
                                loss_mask=np.ones(R, bool), reward=float(rng.random()),
                                source="vqa" if workload == "vlm" else "text", group_id=gid,
                                index_in_group=i, versions=(0,), image_ids=ids))
      metas = w.append(trajs, images=images)
      groups.append(GroupInfo(gid, metas[0].source, sum(m.length for m in metas), 0,
                              metas=tuple(metas)))
    batches.append(MiniBatch(0, k, tuple(groups), 0))
  return store, batches


def consumer(rank, store_url, plan, seq, depth, conn, results, go, ready):
  os.environ["XLA_FLAGS"] = ""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from knittrans_jax.dataplane import PrefetchingReader
  from knittrans_jax.dataplane import centralized as C
  from knittrans_jax.models import DecoderConfig, DecoderLM
  from knittrans_jax.rl.losses import nll_loss_sum
  from knittrans_jax.storage import TrajectoryStore

  with nnx.use_eager_sharding(False):
    model = DecoderLM(DecoderConfig(), nnx.Rngs(rank))
  graphdef, params = nnx.split(model, nnx.Param)

  @jax.jit
  def step(params, tokens, mask):
    def loss(p):
      logits = nnx.merge(graphdef, p)(tokens, mask)
      return nll_loss_sum(logits, {"tokens": tokens, "loss_mask": mask})[0]
    return jax.grad(loss)(params)

  rows = len(plan[0])

  def prepare(payload):
    tokens = np.zeros((rows, seq), np.int32)
    mask = np.zeros((rows, seq), np.float32)
    for i, t in enumerate(payload.tokens):
      L = min(t.size, seq)
      tokens[i, :L], mask[i, :L] = t[:L], 1
    return tokens, mask, sum(img.size for img in payload.images.values())

  def put(batch):
    tokens, mask, _ = batch
    return jax.device_put(tokens), jax.device_put(mask)

  def compute(batch):
    jax.block_until_ready(step(params, batch[0], batch[1]))

  compute(put(prepare(_empty(rows, seq))))  # compile before anything is timed
  store = TrajectoryStore.open(store_url)
  for unit in store.units():  # a long-running consumer has its units open already
    store.reader(unit)
  ready.wait()
  results.put(("ready", rank))
  for mode in ("baseline", "ondemand"):
    go[mode].wait()
    t0 = time.perf_counter()
    if mode == "baseline":
      data = conn.recv_bytes()
      t_recv = time.perf_counter()
      micro = [C.to_payload(samples) for samples in C.deserialize(data)]
      t_ready = time.perf_counter()
      driver_s = conn.recv()  # when the driver had this slice ready to send
      h2d = 0.0
      for payload in micro:
        t1 = time.perf_counter()
        batch = put(prepare(payload))
        h2d += time.perf_counter() - t1
        compute(batch)
      # Nothing overlaps compute here: the whole transfer phase (gather, slicing,
      # pickling, the pipe, unpickling) and each padding + host-to-device is both
      # raw transfer time and exposed wait.
      results.put((mode, rank, {"exposed_s": t_ready - t0 + h2d, "raw_transfer_s": t_ready - t0 + h2d,
                                "driver_s": driver_s, "recv_s": t_recv - t0,
                                "unpickle_s": t_ready - t_recv, "bytes": len(data),
                                "total_s": time.perf_counter() - t0}))
    else:
      with PrefetchingReader(store, plan, prepare, depth, put) as reader:
        for batch in reader:
          compute(batch)
      results.put((mode, rank, {"exposed_s": reader.stats.exposed_wait_s,
                                "first_wait_s": reader.stats.waits[0],
                                "raw_transfer_s": reader.stats.raw_transfer_s,
                                "bytes": reader.stats.bytes_read,
                                "total_s": time.perf_counter() - t0}))


def _empty(rows, seq):
  from knittrans_jax.types import Payload
  return Payload(metas=[], tokens=[np.zeros(seq, np.int32)] * rows, logprobs=[],
                 loss_mask=[], images={})


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workload", choices=["text", "vlm"], required=True)
  parser.add_argument("--json", required=True)
  parser.add_argument("--consumers", type=int, default=2)
  parser.add_argument("--prompts", type=int, default=32, help="prompts (groups) per mini-batch")
  parser.add_argument("--mini_batches", type=int, default=2)
  parser.add_argument("--micro", type=int, default=16, help="trajectories per micro-batch")
  parser.add_argument("--seq", type=int, default=256, help="tokens per row of the compute step")
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--dir", default=None)
  args = parser.parse_args()

  from knittrans_jax.dataplane import centralized as C
  from knittrans_jax.dataplane import plan_micro_batches

  base = args.dir or tempfile.mkdtemp(prefix="bench_transfer_")
  root = os.path.join(os.path.abspath(base), "store")
  shutil.rmtree(root, ignore_errors=True)
  t0 = time.perf_counter()
  store, batches = build_store(root, args.workload, args.mini_batches, args.prompts)
  print(f"store written in {time.perf_counter() - t0:.1f} s")
  plans = [[] for _ in range(args.consumers)]
  for mb in batches:
    plan = plan_micro_batches(mb, args.consumers, args.micro)
    for c in range(args.consumers):
      plans[c] += [list(m) for m in plan.consumers[c]]
  all_metas = [m for mb in batches for grp in mb.groups for m in grp.metas]

  for unit in store.units():  # so does the driver (both sides alike)
    store.reader(unit)
  ctx = mp.get_context("spawn")
  results, ready = ctx.Queue(), ctx.Event()
  go = {m: ctx.Event() for m in ("baseline", "ondemand")}
  pipes = [ctx.Pipe() for _ in range(args.consumers)]
  procs = [ctx.Process(target=consumer, args=(c, store.url, plans[c], args.seq, args.depth,
                                              pipes[c][1], results, go, ready))
           for c in range(args.consumers)]
  for p in procs:
    p.start()
  ready.set()
  for _ in range(args.consumers):
    assert results.get(timeout=600)[0] == "ready"
  out = {"workload": args.workload, "consumers": args.consumers, "prompts": args.prompts,
         "mini_batches": args.mini_batches, "n": N, "micro": args.micro,
         "trajectories": len(all_metas), "cpu_count": os.cpu_count()}
  bar = tqdm(total=2, desc="modes", leave=False)

  # Baseline: the driver gathers, slices, pickles and sends, consumer by consumer.
  go["baseline"].set()
  t_start = time.perf_counter()
  payload = C.gather(store, all_metas)
  driver_read = payload.nbytes
  sent = 0
  for c in range(args.consumers):
    data = C.serialize(C.consumer_slice(payload, plans[c]))
    elapsed = time.perf_counter() - t_start
    pipes[c][0].send_bytes(data)
    pipes[c][0].send(elapsed)
    sent += len(data)
    del data
  del payload
  base_res = {}
  while len(base_res) < args.consumers:
    mode, rank, r = results.get(timeout=1200)
    base_res[rank] = r
  bar.update()
  go["ondemand"].set()
  on_res = {}
  while len(on_res) < args.consumers:
    mode, rank, r = results.get(timeout=1200)
    on_res[rank] = r
  bar.update()
  bar.close()
  for p in procs:
    p.join(timeout=60)
  if args.dir is None:
    shutil.rmtree(base, ignore_errors=True)

  agg = lambda res, key: max(r[key] for r in res.values())
  out["baseline"] = {"exposed_s": agg(base_res, "exposed_s"),
                     "raw_transfer_s": agg(base_res, "raw_transfer_s"),
                     "total_s": agg(base_res, "total_s"), "per_consumer": base_res}
  out["ondemand"] = {"exposed_s": agg(on_res, "exposed_s"),
                     "raw_transfer_s": agg(on_res, "raw_transfer_s"),
                     "total_s": agg(on_res, "total_s"), "per_consumer": on_res}
  out["bytes_moved"] = {"baseline": driver_read + sent,
                        "ondemand": sum(r["bytes"] for r in on_res.values())}
  out["exposed_ratio"] = out["baseline"]["exposed_s"] / max(out["ondemand"]["exposed_s"], 1e-9)
  out["raw_ratio"] = out["baseline"]["raw_transfer_s"] / max(out["ondemand"]["raw_transfer_s"], 1e-9)
  out["total_ratio"] = out["baseline"]["total_s"] / out["ondemand"]["total_s"]
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"\ntransfer, workload {args.workload}: {len(all_metas)} trajectories, "
        f"{args.consumers} consumers, {os.cpu_count()} cores")
  print(f"  {'':<12}{'exposed s':>12}{'raw s':>10}{'total s':>10}{'MB moved':>12}")
  for mode in ("baseline", "ondemand"):
    r = out[mode]
    print(f"  {mode:<12}{r['exposed_s']:>12.4f}{r['raw_transfer_s']:>10.3f}{r['total_s']:>10.2f}"
          f"{out['bytes_moved'][mode] / 2**20:>12.1f}")
  print(f"  exposed_ratio {out['exposed_ratio']:.1f}  raw_ratio {out['raw_ratio']:.1f}  "
        f"total_ratio {out['total_ratio']:.2f}")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
