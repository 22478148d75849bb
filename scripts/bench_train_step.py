"""Training throughput per mesh layout with the default tiny model (report only).

  python scripts/bench_train_step.py --json runs/bench_train_step.json

For each of configs/mesh/{dp,fsdp,fsdp_tp}.gin: tokens per second of the job's
`micro_step` on one micro-batch (gradients into a fresh accumulator), and of a whole
mini-batch update (--micro_batches micro steps, then `apply_step`). Compilation is excluded
(one warm-up); figures are medians of --reps. Run with
XLA_FLAGS=--xla_force_host_platform_device_count=8 on a CPU to get 8 devices.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import gin
import jax
import numpy as np

from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rl import LossConfig
from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, init_train_state,
                                 make_mesh, make_optimizer)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_batch(rng, B, T, vocab):
  return dict(tokens=rng.integers(0, vocab, (B, T)).astype(np.int32),
              attention_mask=np.ones((B, T), bool), loss_mask=np.ones((B, T), np.float32),
              behaviour_logp=np.full((B, T), -np.log(vocab), np.float32),
              advantages=rng.normal(size=B).astype(np.float32))


def bench_layout(layout, B, T, micro_batches, reps):
  gin.clear_config()
  gin.parse_config_file(os.path.join(REPO, "configs", "mesh", f"{layout}.gin"))
  mesh_cfg = MeshConfig()
  model_cfg = DecoderConfig()
  mesh = make_mesh(mesh_cfg)
  tx = make_optimizer(OptimizerConfig())
  graphdef, state, shardings = init_train_state(lambda r: DecoderLM(model_cfg, r), tx, mesh,
                                                mesh_cfg.rules)
  fns = StepFunctions(graphdef, shardings, tx, LossConfig(), mesh, mesh_cfg.rules)
  rng = np.random.default_rng(0)
  micros = [make_batch(rng, B, T, model_cfg.vocab_size) for _ in range(micro_batches)]
  total = float(B * T * micro_batches)

  def fresh():
    acc, sums = fns.zero_grads(state.params), fns.zero_sums(state, micros[0])
    return jax.block_until_ready((acc, sums))  # zeros made outside the timed span

  def grad_once(acc, sums):
    jax.block_until_ready(fns.micro_step(state, acc, sums, micros[0], total))

  def update_once(acc, sums):
    nonlocal state
    for m in micros:
      acc, sums = fns.micro_step(state, acc, sums, m, total)
    state, metrics = fns.apply_step(state, acc)
    jax.block_until_ready(metrics)

  grad_once(*fresh()); update_once(*fresh())  # compile
  g_times, u_times = [], []
  for _ in range(reps):
    zeros = fresh()
    t0 = time.perf_counter(); grad_once(*zeros); g_times.append(time.perf_counter() - t0)
    zeros = fresh()
    t0 = time.perf_counter(); update_once(*zeros); u_times.append(time.perf_counter() - t0)
  return {"mesh": dict(mesh.shape), "micro_step_tokens_per_s": B * T / statistics.median(g_times),
          "tokens_per_s": B * T * micro_batches / statistics.median(u_times),
          "micro_step_ms": 1e3 * statistics.median(g_times),
          "update_ms": 1e3 * statistics.median(u_times)}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True)
  parser.add_argument("--batch", type=int, default=16, help="rows per micro-batch")
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--micro_batches", type=int, default=4)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--layouts", default="dp,fsdp,fsdp_tp")
  args = parser.parse_args()
  out = {"devices": [str(d) for d in jax.devices()], "batch": args.batch, "seq": args.seq,
         "micro_batches": args.micro_batches, "layouts": {}}
  for layout in args.layouts.split(","):
    out["layouts"][layout] = bench_layout(layout, args.batch, args.seq, args.micro_batches, args.reps)
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"\ntiny decoder, {args.batch} x {args.seq} tokens per micro-batch, "
        f"{args.micro_batches} per mini-batch, {len(jax.devices())} {jax.devices()[0].platform} devices")
  print(f"  {'layout':<10}{'mesh':<26}{'micro_step tok/s':>17}{'update tok/s':>14}")
  for name, r in out["layouts"].items():
    print(f"  {name:<10}{str(r['mesh']):<26}{r['micro_step_tokens_per_s']:>17.0f}{r['tokens_per_s']:>14.0f}")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
