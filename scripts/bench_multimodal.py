"""Multimodal benchmark: transfer plus training per mini-batch, four ways, one run.

  python scripts/bench_multimodal.py --json runs/bench_multimodal.json
  python scripts/bench_multimodal.py --json runs/bench_multimodal_sweep.json --sweep

A real store on disk (file://, 4 producer units) holds --mini_batches mini-batches
of --prompts GRPO groups, n responses each, one float32 image of --image x --image
x 3 per prompt, stored once. --consumers consumer processes (one CPU device each)
split every mini-batch (planned as the job plans it, job/work.py; whole groups per
consumer) and each takes a full optimizer step of the tiny VLM (ViT + projector +
decoder, the widths of configs/vlm_grpo_tiny.gin; 14-pixel patches and a 2 x 2
merge as in Qwen2-VL, so a 448 image is 1024 ViT tokens and 256 LM tokens; or, with
--model, a Qwen2-VL / Qwen2.5-VL checkpoint's tower and decoder, uint8 images run
through its image processor at the consumer, prompts with the image-pad run) on its
share with the job's own trainer (job/trainer.py): GRPO loss, grads over its
micro-batches, AdamW update. The cross-consumer gradient all-reduce is left out:
it is the same in all four variants. The variants differ only in the trainer's
data path (`Centralized` or `OnDemand`) and step (naive or encode-once):

  baseline       centralized transfer (a driver gathers the train batch, copies the
                 image into every trajectory, pickles each consumer's slice through
                 a pipe; compute starts when it has arrived) + the naive step (the
                 encoder runs on every trajectory's image in every micro-batch)
  dedup_only     the same transfer + the encode-once step (images deduplicated by id
                 on arrival, encoded once per mini-batch, one encoder VJP)
  ondemand_only  on-demand reads (each consumer reads its own micro-batches from the
                 units, each image once, prefetching while it computes) + the naive step
  knittrans      on-demand reads of the micro-batches and, once, of the consumer's
                 image slots + the encode-once step

Each variant's time is from its go signal until every consumer has applied its last
update, divided by the number of mini-batches; the max over consumers is reported.
Everything is compiled before any timing. Before timing, every consumer also
computes its first mini-batch's gradient both ways through the trainer
(step(apply=False)) on the same data (grad_max_rel_err: the largest per-parameter
max|dedup - naive| / max|naive|) and counts the images its encoder runs on
(encoder_forwards, summed over consumers).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time

import numpy as np
from tqdm import tqdm

from knittrans_jax import cli
from knittrans_jax.bench.multimodal_sweep import sweep
from knittrans_jax.bench.multimodal_workload import (VOCAB, build_store, model_flops, qwen_suite,
                                                     vlm_configs)

VARIANTS = ("baseline", "dedup_only", "ondemand_only", "knittrans")


def consumer(rank, store_url, works, args_dict, conn, results, go, ready):
  """Trains consumer `rank`'s share of `works` (one StepWork per mini-batch)."""
  from knittrans_jax.rollout.worker import one_device_xla_flags
  # One CPU device each; the caller's other XLA flags (e.g. the suite's faster compiles) kept.
  os.environ["XLA_FLAGS"] = one_device_xla_flags(os.environ.get("XLA_FLAGS", ""))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp

  from knittrans_jax.dataplane.centralized import PipeFetch
  from knittrans_jax.job.trainer import BatchLayout, Centralized, OnDemand, Trainer
  from knittrans_jax.models.vision_spec import VisionSpec
  from knittrans_jax.models.vlm import make_model
  from knittrans_jax.multimodal import (EncodeOnceConfig, EncodeOnceStep, EncoderCalls,
                                      naive_vlm_forward)
  from knittrans_jax.rl import LossConfig
  from knittrans_jax.storage import TrajectoryStore
  from knittrans_jax.suites import QwenVLSuite, VisionSuite
  from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, init_train_state,
                                   make_mesh, make_optimizer)

  a = argparse.Namespace(**args_dict)
  mesh_cfg = MeshConfig()
  mesh = make_mesh(mesh_cfg)
  tx = make_optimizer(OptimizerConfig(learning_rate=1e-4))
  qwen = qwen_suite(a)
  if qwen is None:
    vit, lm = vlm_configs(a)
    spec = VisionSpec.tiny(vit)
    graphdef, state0, sh = init_train_state(lambda r: make_model(lm, spec, r), tx, mesh,
                                            mesh_cfg.rules, 0)
    naive_forward, path, seq, vocab = naive_vlm_forward, None, a.seq, VOCAB
  else:  # the checkpoint's weights, its tower per row (naive) or per unique image
    from flax import nnx

    from knittrans_jax.models import qwen_vl
    from knittrans_jax.multimodal import QwenVLImages, naive_qwen_forward
    model, config = qwen_vl.load(a.model, "float32", mesh=mesh, rules=mesh_cfg.rules)
    spec = qwen.spec
    graphdef, state0, sh = init_train_state(lambda r: make_model(None, spec, r), tx, mesh,
                                            mesh_cfg.rules, 0,
                                            params=nnx.state(model, nnx.Param))
    naive_forward = lambda calls=None: naive_qwen_forward(qwen.grid, calls)  # noqa: E731
    path, seq, vocab = QwenVLImages(config.vision.merge), a.seq + qwen.prompt_len, \
        config.text.vocab_size

  def fns_with(forward):
    return StepFunctions(graphdef, sh, tx, LossConfig(), mesh, mesh_cfg.rules, forward=forward)
  fns = fns_with(naive_forward())
  steps = {False: None, True: EncodeOnceStep(fns, EncodeOnceConfig(), path=path)}
  layout = BatchLayout(rows=a.micro, seq_len=seq, vocab_size=vocab)
  suite = VisionSuite(spec) if qwen is None else QwenVLSuite(spec)  # the trainer's image fields
  store = TrajectoryStore.open(store_url)
  for unit in store.units():
    store.reader(unit)

  def trainer(data, dedup, f=fns, step=None):
    step = (step or steps[True]) if dedup else None
    fields = suite.shared_fields(layout, step) if dedup else suite.naive_fields(layout)
    return Trainer(f, jax.tree.map(jnp.copy, state0), data, layout, [rank], fields=fields,
                   shared_step=step)

  # -- exactness and encoder counts (untimed; compiles the counted variants) -------
  calls = EncoderCalls()
  counted = fns_with(naive_forward(calls))
  naive = trainer(OnDemand(store), False, counted).step(works[0], apply=False)
  jax.block_until_ready(naive.grads)
  jax.effects_barrier()
  naive_forwards = calls.forward_images
  calls.reset()
  dedup = trainer(OnDemand(store), True, step=EncodeOnceStep(fns, EncodeOnceConfig(), calls=calls, path=path)).step(
      works[0], apply=False)
  jax.block_until_ready(dedup.grads)
  jax.effects_barrier()
  err = 0.0
  for g, w in zip(jax.tree.leaves(jax.device_get(dedup.grads)),
                  jax.tree.leaves(jax.device_get(naive.grads))):
    err = max(err, float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30)))
  results.put(("check", rank, {"grad_max_rel_err": err, "naive_forwards": naive_forwards,
                               "dedup_forwards": calls.forward_images,
                               "unique_images": len(works[0].images.owned[rank])}))
  # -- compile the timed steps on a first mini-batch --------------------------------
  for d in (False, True):
    warm = trainer(OnDemand(store), d)
    jax.block_until_ready(warm.step(works[0]).sums)
    warm.close()
  ready.wait()
  results.put(("ready", rank))

  for variant in VARIANTS:
    centralized = variant in ("baseline", "dedup_only")
    dedup = variant in ("dedup_only", "knittrans")
    t = trainer(Centralized(PipeFetch(conn)) if centralized else OnDemand(store, a.depth), dedup)
    jax.block_until_ready(t.state)
    go[variant].wait()
    t0 = time.perf_counter()
    if not centralized:
      for w in works:  # the stream of every mini-batch, read ahead of compute
        t.prefetch(w)
    for w in works:
      t.step(w)
    jax.block_until_ready(t.state)
    results.put((variant, rank, {"total_s": time.perf_counter() - t0,
                                 "exposed_s": t.exposed_wait_s}))
    t.close()


def run_point(args) -> dict:
  from knittrans_jax.dataplane import centralized as C
  from knittrans_jax.job.work import StepPlanner

  base = args.dir or tempfile.mkdtemp(prefix="bench_multimodal_")
  root = os.path.join(os.path.abspath(base), "store")
  shutil.rmtree(root, ignore_errors=True)
  t0 = time.perf_counter()
  store, batches = build_store(root, args)
  print(f"store written in {time.perf_counter() - t0:.1f} s", flush=True)
  # Slots per consumer: at least its groups' images (one per group), a fixed shape.
  planner = StepPlanner(args.consumers, args.consumers * args.micro,
                        image_slots=(1, -(-args.prompts // args.consumers)))
  works = [planner(mb) for mb in batches]
  all_metas = [m for mb in batches for grp in mb.groups for m in grp.metas]
  for unit in store.units():
    store.reader(unit)
  ctx = mp.get_context("spawn")
  results, ready = ctx.Queue(), ctx.Event()
  go = {v: ctx.Event() for v in VARIANTS}
  pipes = [ctx.Pipe() for _ in range(args.consumers)]
  procs = [ctx.Process(target=consumer, args=(c, store.url, works, vars(args), pipes[c][1],
                                              results, go, ready))
           for c in range(args.consumers)]
  for p in procs:
    p.start()

  def get():
    """The next consumer report; a consumer that died (e.g. out of memory) is named."""
    while True:
      try:
        return results.get(timeout=1.0)
      except queue.Empty:
        for c, p in enumerate(procs):
          if not p.is_alive() and p.exitcode != 0:
            for q in procs:
              q.kill()
            raise RuntimeError(f"consumer {c} died with exit code {p.exitcode} (a negative "
                               "code is the signal, e.g. -9 when out of memory)")

  checks = {}
  while len(checks) < args.consumers:
    kind, rank, r = get()
    assert kind == "check", kind
    checks[rank] = r
  ready.set()
  for _ in range(args.consumers):
    assert get()[0] == "ready"
  timings = {}
  for variant in tqdm(VARIANTS, desc="variants", leave=False):
    go[variant].set()
    if variant in ("baseline", "dedup_only"):
      # The driver: gather the train batch, slice per consumer with the image copied
      # into every trajectory, pickle, send (the consumer waits for all of it).
      payload, started = C.gather(store, all_metas), time.perf_counter()
      for c in range(args.consumers):
        C.send_slices(pipes[c][0], payload, [m for w in works for m in w.local_micro_batches([c])],
                      started)
      del payload
    res = {}
    while len(res) < args.consumers:
      kind, rank, r = get()
      assert kind == variant, (kind, variant)
      res[rank] = r
    timings[variant] = res
  for p in procs:
    p.join(timeout=60)
  if args.dir is None:
    shutil.rmtree(base, ignore_errors=True)
  per_mb = {v: max(r["total_s"] for r in timings[v].values()) / args.mini_batches for v in VARIANTS}
  out = {
      "config": {k: v for k, v in vars(args).items() if k not in ("json", "dir", "sweep")},
      "cpu_count": os.cpu_count(),
      "baseline_s": per_mb["baseline"],
      "knittrans_s": per_mb["knittrans"],
      "speedup": per_mb["baseline"] / per_mb["knittrans"],
      "ablation": {"dedup_only_s": per_mb["dedup_only"], "ondemand_only_s": per_mb["ondemand_only"]},
      "exposed_s": {v: max(r["exposed_s"] for r in timings[v].values()) / args.mini_batches
                    for v in VARIANTS},
      "grad_max_rel_err": max(c["grad_max_rel_err"] for c in checks.values()),
      "encoder_forwards": {"baseline": sum(c["naive_forwards"] for c in checks.values()),
                           "knittrans": sum(c["dedup_forwards"] for c in checks.values()),
                           "unique_images": sum(c["unique_images"] for c in checks.values())},
      "flops": None if args.model else model_flops(args),
      "per_consumer": timings,
  }
  return out


def print_point(out):
  c = out["config"]
  print(f"\nmultimodal, per mini-batch: {c['prompts']} prompts x n = {c['n']}, {c['image']}^2 "
        f"images, {c['consumers']} consumers, {out['cpu_count']} cores")
  for name, key in (("baseline", "baseline_s"), ("knittrans", "knittrans_s")):
    print(f"  {name:<15}{out[key]:>9.3f} s")
  for name in ("dedup_only", "ondemand_only"):
    print(f"  {name:<15}{out['ablation'][name + '_s']:>9.3f} s")
  print(f"  speedup {out['speedup']:.2f}  grad_max_rel_err {out['grad_max_rel_err']:.2e}  "
        f"encoder forwards {out['encoder_forwards']['baseline']} -> "
        f"{out['encoder_forwards']['knittrans']}")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True)
  parser.add_argument("--consumers", type=int, default=2)
  parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) per mini-batch")
  parser.add_argument("--n", type=int, default=8, help="responses per prompt")
  parser.add_argument("--mini_batches", type=int, default=2)
  parser.add_argument("--micro", type=int, default=16, help="trajectories per micro-batch")
  parser.add_argument("--seq", type=int, default=64, help="text tokens per row (prompt + response)")
  parser.add_argument("--image", type=int, default=448, help="image side, pixels")
  parser.add_argument("--patch", type=int, default=14, help="ViT patch side, pixels")
  parser.add_argument("--merge", type=int, default=2,
                      help="m x m patches -> one LM token (448, 14, 2: 1024 ViT, 256 LM tokens)")
  parser.add_argument("--vit_width", type=int, default=64)
  parser.add_argument("--lm_width", type=int, default=64)
  parser.add_argument("--depth", type=int, default=2, help="micro-batches read ahead")
  parser.add_argument("--model", default=None,
                      help="a Qwen2-VL / Qwen2.5-VL checkpoint directory: its model in place of "
                           "the tiny VLM (uint8 images of --image px through its processor)")
  parser.add_argument("--dir", default=None)
  parser.add_argument("--sweep", action="store_true", help="one knob at a time; JSON + PNG")
  cli.add_check_flag(parser)
  args = parser.parse_args()
  if not args.model and args.image % (args.patch * args.merge):
    parser.error(f"--image {args.image} is not a multiple of --patch {args.patch} x --merge "
                 f"{args.merge}")
  if cli.check_only(args):
    return
  if args.sweep:
    out = sweep(args, __file__)
  else:
    out = run_point(args)
    print_point(out)
  write_json(args.json, out)


def write_json(path: str, out: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
