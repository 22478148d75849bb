"""Transfer benchmark: centralized baseline vs on-demand reads, side by side.

  python scripts/bench_transfer.py --workload vlm --json runs/bench_transfer_vlm.json
  python scripts/bench_transfer.py --workload text --json runs/bench_transfer_text.json

A real store on disk (file://, 4 producer units) holds a train batch of
--mini_batches x --prompts groups of n = 8 responses (`vlm`: one 448 x 448 x 3
float32 image per prompt, stored once; with --no-dedup stored, and read, once per
trajectory, for a comparison at equal bytes). Prompts are --seq / 4 tokens and responses
log-normal around --seq / 2, cut to fit --seq. Each mini-batch is planned over
--consumers consumer processes (job/work.py, as the job plans it) and every
consumer trains its share with the job's own trainer (job/trainer.py): the GRPO
loss of the default decoder over its micro-batches, then the AdamW update (the
cross-consumer all-reduce is left out; it is the same for both). The vlm workload
moves the images but trains the text decoder: this benchmark is about moving data.
Then, in the same run:

  baseline   a driver (this process) gathers the whole train batch from the units,
             builds each consumer's slice with the image copied into every
             trajectory, pickles it and sends it through a pipe; the consumer's
             trainer (data path `Centralized`) unpickles it, then computes.
  prefetch   the same driver with one step of prefetch (double buffering), the
             strongest simple thing a user would write: it gathers and sends
             mini-batch by mini-batch, and a thread in each consumer receives and
             unpickles mini-batch k + 1 while k computes
             (dataplane/centralized.PrefetchPipeFetch).
  ondemand   each consumer's trainer (data path `OnDemand`) reads only its own
             micro-batches from the units, the stream of every mini-batch fed at
             the start, --depth micro-batches ahead of compute.

exposed_s: time a consumer's devices waited for data (the trainer's measure: the
wait for a micro-batch after the compute before it finished), summed over its
micro-batches; the max over consumers is reported. raw_transfer_s: time spent
moving data for a consumer (baseline: from the go signal until its slice is
unpickled, plus padding and host-to-device per micro-batch; ondemand: reads +
padding + host-to-device, summed, whether or not it overlapped compute); max over
consumers; prefetch: the receiving thread's receive + unpickle time plus the
trainer's take time outside its wait for that thread. bytes_moved: baseline and
prefetch = what the driver read + every pickled slice; ondemand = what the consumers
read.

JSON: `baselines.centralized` (= `baseline`) and `baselines.centralized_prefetch`,
each {exposed_s, raw_transfer_s, total_s, bytes_moved, exposed_ratio, raw_ratio,
total_ratio} with the ratios of that baseline over on-demand; `total_ratio` (the
headline: transfer + training, end to end) is against the strongest,
centralized_prefetch.
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

from knittrans_jax import cli

N = 8
MODES = ("baseline", "prefetch", "ondemand")
VOCAB = 256  # the default decoder's vocabulary


def build_store(root, workload, mini_batches, prompts, seq, seed=0, dedup=True):
  from knittrans_jax.storage import Image, StoreSchema, TrajectoryStore
  from knittrans_jax.types import GroupInfo, MiniBatch, Trajectory
  rng = np.random.default_rng(seed)
  store = TrajectoryStore.create("file://" + root, StoreSchema(
      sources=("text", "vqa"), max_prompt_len=seq, max_response_len=seq, dedup_images=dedup))
  writers = [store.writer(f"producer{p}", host=f"host{p % 2}") for p in range(4)]
  batches = []
  P = seq // 4
  for k in range(mini_batches):
    groups = []
    for g in range(prompts):
      gid = k * prompts + g
      w = writers[gid % len(writers)]
      images, ids = [], ()
      if workload == "vlm":
        img = Image.of(rng.random((448, 448, 3), dtype=np.float32))  # hashed once, here
        images, ids = [img], (img.id,)
      prompt = rng.integers(0, VOCAB, P, dtype=np.int32)
      trajs = []
      for i in range(N):
        R = int(np.clip(rng.lognormal(np.log(seq / 2), 0.5), 4, seq - P))
        trajs.append(Trajectory(prompt_tokens=prompt,
                                response_tokens=rng.integers(0, VOCAB, R, dtype=np.int32),
                                logprobs=-rng.uniform(4.5, 6.5, R).astype(np.float32),
                                loss_mask=np.ones(R, bool), reward=float(rng.random()),
                                source="vqa" if workload == "vlm" else "text", group_id=gid,
                                index_in_group=i, versions=(0,), image_ids=ids))
      metas = w.append(trajs, images=images)
      groups.append(GroupInfo.from_metas(metas))
    batches.append(MiniBatch(0, k, tuple(groups), 0))
  return store, batches


def consumer(rank, store_url, works, seq, depth, conn, results, go, ready):
  from knittrans_jax.rollout.worker import one_device_xla_flags
  # One CPU device each; the caller's other XLA flags (e.g. the suite's faster compiles) kept.
  os.environ["XLA_FLAGS"] = one_device_xla_flags(os.environ.get("XLA_FLAGS", ""))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp

  from knittrans_jax.dataplane.centralized import PipeFetch, PrefetchPipeFetch
  from knittrans_jax.job.trainer import BatchLayout, Centralized, OnDemand, Trainer
  from knittrans_jax.models import DecoderConfig, DecoderLM
  from knittrans_jax.rl import LossConfig
  from knittrans_jax.storage import TrajectoryStore
  from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, init_train_state,
                                   make_mesh, make_optimizer)

  mesh_cfg = MeshConfig()
  mesh = make_mesh(mesh_cfg)
  tx = make_optimizer(OptimizerConfig(learning_rate=1e-4))
  graphdef, state0, sh = init_train_state(lambda r: DecoderLM(DecoderConfig(), r), tx, mesh,
                                          mesh_cfg.rules, rank)
  fns = StepFunctions(graphdef, sh, tx, LossConfig(), mesh, mesh_cfg.rules)
  rows = len(works[0].consumers[rank][0])
  layout = BatchLayout(rows=rows, seq_len=seq, vocab_size=DecoderConfig().vocab_size)
  store = TrajectoryStore.open(store_url)
  for unit in store.units():  # a long-running consumer has its units open already
    store.reader(unit)

  def trainer(data):
    return Trainer(fns, jax.tree.map(jnp.copy, state0), data, layout, [rank])

  warm = trainer(OnDemand(store, depth))  # compiles everything before anything is timed
  jax.block_until_ready(warm.step(works[0]).sums)
  warm.close()
  ready.wait()
  results.put(("ready", rank))
  for mode in MODES:
    pipe = PrefetchPipeFetch(conn, len(works)) if mode == "prefetch" else PipeFetch(conn)
    t = trainer(OnDemand(store, depth) if mode == "ondemand" else Centralized(pipe))
    go[mode].wait()
    t0 = time.perf_counter()
    if mode == "ondemand":
      for w in works:  # the whole stream fed at once: reads run ahead of compute
        t.prefetch(w)
    for w in works:
      t.step(w)
    jax.block_until_ready(t.state)
    total = time.perf_counter() - t0
    stats = t.stream.stats
    out = {"exposed_s": stats.exposed_wait_s, "raw_transfer_s": stats.raw_transfer_s,
           "total_s": total, "first_wait_s": stats.waits[0]}
    if mode == "baseline":  # nothing overlaps compute: the transfer phase is all exposed
      out.update(pipe.stats)
    elif mode == "prefetch":  # the thread's transfer, and the takes' time outside its wait
      pipe.close()
      out.update(pipe.stats)
      out["raw_transfer_s"] = (stats.raw_transfer_s - pipe.stats["wait_s"]
                               + pipe.stats["recv_s"] + pipe.stats["unpickle_s"])
    else:
      out["bytes"] = t.reads.stats.bytes_read
    t.close()
    results.put((mode, rank, out))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workload", choices=["text", "vlm"], required=True)
  parser.add_argument("--json", required=True)
  parser.add_argument("--consumers", type=int, default=2)
  parser.add_argument("--prompts", type=int, default=32, help="prompts (groups) per mini-batch")
  parser.add_argument("--mini_batches", type=int, default=2)
  parser.add_argument("--micro", type=int, default=16, help="trajectories per micro-batch")
  parser.add_argument("--seq", type=int, default=256,
                      help="tokens per row (prompt + response) of the trainer's step")
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--dir", default=None)
  parser.add_argument("--no-dedup", dest="dedup", action="store_false",
                      help="store (and read) each trajectory's own copy of its image: both "
                           "data paths then move the same image bytes")
  cli.add_check_flag(parser)
  args = parser.parse_args()
  if cli.check_only(args):
    return

  from knittrans_jax.dataplane import centralized as C
  from knittrans_jax.job.work import StepPlanner

  base = args.dir or tempfile.mkdtemp(prefix="bench_transfer_")
  root = os.path.join(os.path.abspath(base), "store")
  shutil.rmtree(root, ignore_errors=True)
  t0 = time.perf_counter()
  store, batches = build_store(root, args.workload, args.mini_batches, args.prompts, args.seq,
                               dedup=args.dedup)
  print(f"store written in {time.perf_counter() - t0:.1f} s")
  planner = StepPlanner(args.consumers, args.consumers * args.micro)
  works = [planner(mb) for mb in batches]
  plans = [[list(m) for w in works for m in w.local_micro_batches([c])]
           for c in range(args.consumers)]
  all_metas = [m for mb in batches for grp in mb.groups for m in grp.metas]

  for unit in store.units():  # so does the driver (both sides alike)
    store.reader(unit)
  ctx = mp.get_context("spawn")
  results, ready = ctx.Queue(), ctx.Event()
  go = {m: ctx.Event() for m in MODES}
  pipes = [ctx.Pipe() for _ in range(args.consumers)]
  procs = [ctx.Process(target=consumer, args=(c, store.url, works, args.seq, args.depth,
                                              pipes[c][1], results, go, ready))
           for c in range(args.consumers)]
  for p in procs:
    p.start()
  ready.set()
  for _ in range(args.consumers):
    assert results.get(timeout=600)[0] == "ready"
  out = {"workload": args.workload, "consumers": args.consumers, "prompts": args.prompts,
         "mini_batches": args.mini_batches, "n": N, "micro": args.micro,
         "trajectories": len(all_metas), "dedup_images": args.dedup,
         "cpu_count": os.cpu_count()}
  bar = tqdm(total=len(MODES), desc="modes", leave=False)

  # Baseline: the driver gathers, slices, pickles and sends, consumer by consumer.
  go["baseline"].set()
  t_start = time.perf_counter()
  payload = C.gather(store, all_metas)
  driver_read = payload.nbytes_read  # every image copy it read (one each without dedup)
  sent = 0
  for c in range(args.consumers):
    sent += C.send_slices(pipes[c][0], payload, plans[c], t_start)
  del payload
  base_res = {}
  while len(base_res) < args.consumers:
    mode, rank, r = results.get(timeout=1200)
    base_res[rank] = r
  bar.update()
  # The prefetching baseline: gathered and sent mini-batch by mini-batch.
  go["prefetch"].set()
  t_start = time.perf_counter()
  pre_read, pre_sent = C.stream_slices(
      [p[0] for p in pipes], store, [[m for grp in mb.groups for m in grp.metas] for mb in batches],
      [[list(w.local_micro_batches([c])) for w in works] for c in range(args.consumers)], t_start)
  pre_res = {}
  while len(pre_res) < args.consumers:
    mode, rank, r = results.get(timeout=1200)
    pre_res[rank] = r
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
  summary = lambda res: {k: agg(res, k) for k in ("exposed_s", "raw_transfer_s", "total_s")}
  out["ondemand"] = {**summary(on_res), "per_consumer": on_res}
  out["bytes_moved"] = {"baseline": driver_read + sent, "prefetch": pre_read + pre_sent,
                        "ondemand": sum(r["bytes"] for r in on_res.values())}
  on = out["ondemand"]
  out["baselines"] = {}
  for name, res, moved in (("centralized", base_res, driver_read + sent),
                           ("centralized_prefetch", pre_res, pre_read + pre_sent)):
    b = summary(res)
    out["baselines"][name] = {
        **b, "bytes_moved": moved, "per_consumer": res,
        "exposed_ratio": b["exposed_s"] / max(on["exposed_s"], 1e-9),
        "raw_ratio": b["raw_transfer_s"] / max(on["raw_transfer_s"], 1e-9),
        "total_ratio": b["total_s"] / on["total_s"]}
  out["baseline"] = out["baselines"]["centralized"]
  for key in ("exposed_ratio", "raw_ratio"):  # against the centralized baseline, as before
    out[key] = out["baseline"][key]
  out["total_ratio"] = out["baselines"]["centralized_prefetch"]["total_ratio"]
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"\ntransfer, workload {args.workload}: {len(all_metas)} trajectories, "
        f"{args.consumers} consumers, {os.cpu_count()} cores, "
        f"{'images deduplicated' if args.dedup else 'an image copy per trajectory (--no-dedup)'}")
  print(f"  {'':<22}{'exposed s':>12}{'raw s':>10}{'total s':>10}{'MB moved':>12}"
        f"{'total / ondemand':>18}")
  rows = [(name, out["baselines"][name], out["baselines"][name]["bytes_moved"])
          for name in ("centralized", "centralized_prefetch")]
  rows.append(("ondemand", on, out["bytes_moved"]["ondemand"]))
  for name, r, moved in rows:
    ratio = f"{r['total_ratio']:>18.2f}" if "total_ratio" in r else f"{'':>18}"
    print(f"  {name:<22}{r['exposed_s']:>12.4f}{r['raw_transfer_s']:>10.3f}{r['total_s']:>10.2f}"
          f"{moved / 2**20:>12.1f}{ratio}")
  print(f"  total_ratio (end to end, against centralized_prefetch) {out['total_ratio']:.2f}; "
        f"exposed_ratio against centralized {out['exposed_ratio']:.1f}, against "
        f"centralized_prefetch {out['baselines']['centralized_prefetch']['exposed_ratio']:.1f}")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
