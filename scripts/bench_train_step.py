"""Training throughput per mesh layout with the default tiny model (report only).

  python scripts/bench_train_step.py --json runs/bench_train_step.json
  python scripts/bench_train_step.py --packing --json runs/bench_packing.json

--packing: the same trajectories trained padded (a row of seq_len per trajectory)
and packed (JobConfig.packing: rows of seq_len tokens, several trajectories each),
one mini-batch update each way, on the length distributions of
configs/text_long_tails.gin and configs/agentic_tails.gin: `packing.speedup` (trained
tokens per second, packed over padded) and `packing.padding_fraction` (the share of
the token positions the packed step computes that no trajectory fills). A
trajectory's length is the one its task's solution has (prompt, answer and EOS;
for an agentic episode every turn CALL k EOS and every observation RESULT v SEP
between them), drawn from the tasks' own generators: the tail of lengths a policy
that solves the tasks emits (an untrained one stops at random).

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


def build(layout: str):
  """The tiny decoder's step functions and state on a configs/mesh layout."""
  gin.clear_config()
  gin.parse_config_file(os.path.join(REPO, "configs", "mesh", f"{layout}.gin"))
  mesh_cfg = MeshConfig()
  model_cfg = DecoderConfig()
  mesh = make_mesh(mesh_cfg)
  tx = make_optimizer(OptimizerConfig())
  graphdef, state, shardings = init_train_state(lambda r: DecoderLM(model_cfg, r), tx, mesh,
                                                mesh_cfg.rules)
  fns = StepFunctions(graphdef, shardings, tx, LossConfig(), mesh, mesh_cfg.rules)
  return fns, state, mesh, mesh_cfg, model_cfg


def bench_layout(layout, B, T, micro_batches, reps):
  fns, state, mesh, mesh_cfg, model_cfg = build(layout)
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


def solved_lengths(workload: str, groups: int, n: int, seed: int) -> list[int]:
  """Trajectory lengths of `groups` groups of n, sources in the config's quota ratio."""
  from knittrans_jax.rollout import agentic_tasks, tasks
  rng = np.random.default_rng(seed)
  quota = ({"nearest": 6, "count": 5, "long": 5} if workload == "long_tails"
           else {"hop": 10, "nearest": 6})
  sources = [s for s, q in quota.items() for _ in range(q)]
  out = []
  for g in range(groups):
    source = sources[g % len(sources)]
    if workload == "long_tails":
      t = tasks.make_task(rng, source)
      body = {"nearest": 1, "count": t.answer.get("n", 0), "long": t.answer.get("L", 0)}[source]
      length = t.prompt.size + body + 1
    else:
      t = agentic_tasks.make_task(rng, source, agentic_tasks.AgenticTaskConfig())
      length = t.prompt.size + (6 * t.hops - 3 if source == "hop" else 2)
    out += [length] * n  # the n responses of a prompt: the same solution length
  return out


def bench_packing(workload: str, seq_len: int, rows: int, groups: int, n: int, reps: int):
  """One mini-batch update padded and packed on the same trajectories (module doc)."""
  from knittrans_jax.dataplane.packing import PackLayout
  from knittrans_jax.job.batching import build_batch, build_packed_batch
  from knittrans_jax.job.work import StepPlanner
  from knittrans_jax.train.batch import rows_multiple
  from knittrans_jax.types import GroupInfo, MiniBatch, Payload, TrajMeta

  fns, state, mesh, mesh_cfg, model_cfg = build("dp")
  rng = np.random.default_rng(1)
  lengths = solved_lengths(workload, groups, n, seed=0)
  metas, data = [], {}
  for i, L in enumerate(lengths):
    m = TrajMeta("u", i, 0, 4, L - 4, "s", i // n, i % n, 0, 0, 0.0, loss_tokens=L - 4)
    mask = (np.arange(L) >= 4).astype(np.uint8)
    metas.append(m)
    data[m.id] = (rng.integers(0, model_cfg.vocab_size, L).astype(np.int32),
                  np.where(mask, -np.log(model_cfg.vocab_size), 0).astype(np.float32), mask)
  mb = MiniBatch(0, 0, tuple(GroupInfo.from_metas(metas[g * n:(g + 1) * n])
                             for g in range(groups)), 0)

  def payload(ms):
    return Payload(list(ms), *[[data[m.id][j] for m in ms] for j in range(3)], {})

  unit = rows_multiple(mesh, mesh_cfg.rules)  # the packed row counts split over the shards
  padded = StepPlanner(1, rows)(mb)
  packed = StepPlanner(1, rows, pack=PackLayout(seq_len, rows, unit))(mb)
  batches = {
      "padded": [build_batch(payload(ms), padded.advantages, seq_len, rows)
                 for ms in padded.local_micro_batches([0])],
      "packed": [build_packed_batch(payload(ms), packed.advantages,
                                    packed.local_rows([0], k)[1], seq_len,
                                    packed.local_rows([0], k)[0])
                 for k, ms in enumerate(packed.local_micro_batches([0]))]}
  total, real = float(padded.total_tokens), sum(lengths)
  out = {}
  for name, micros in batches.items():
    def update():
      acc, sums = fns.zero_grads(state.params), fns.zero_sums(state, micros[0])
      for m in micros:
        acc, sums = fns.micro_step(state, acc, sums, m, total)
      jax.block_until_ready((acc, sums))

    update()  # compile every shape
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      update()
      times.append(time.perf_counter() - t0)
    computed = sum(b["tokens"].size for b in micros)
    out[name] = {"micro_batches": len(micros), "computed_tokens": computed,
                 "padding_fraction": 1 - real / computed,
                 "row_counts": sorted({b["tokens"].shape[0] for b in micros}),
                 "update_s": statistics.median(times),
                 "trained_tokens_per_s": real / statistics.median(times)}
  return {"workload": workload, "seq_len": seq_len, "rows": rows, "groups": groups, "n": n,
          "trajectories": len(lengths), "tokens": real,
          "length_p50_p90_p99_max": [int(np.percentile(lengths, q)) for q in (50, 90, 99)]
                                    + [max(lengths)],
          **out, "speedup": out["packed"]["trained_tokens_per_s"] / out["padded"]["trained_tokens_per_s"],
          "padding_fraction": out["packed"]["padding_fraction"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True)
  parser.add_argument("--batch", type=int, default=16, help="rows per micro-batch")
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--micro_batches", type=int, default=4)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--layouts", default="dp,fsdp,fsdp_tp")
  parser.add_argument("--packing", action="store_true",
                      help="padded against packed micro-batches (module doc)")
  parser.add_argument("--groups", type=int, default=64, help="--packing: groups a mini-batch")
  args = parser.parse_args()
  if args.packing:
    return main_packing(args)
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


def main_packing(args):
  runs = {"long_tails": bench_packing("long_tails", 528, args.batch, args.groups, 8, args.reps),
          "agentic": bench_packing("agentic", 80, args.batch, args.groups, 8, args.reps)}
  out = {"devices": [str(d) for d in jax.devices()], "packing": runs}
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"\ntiny decoder, one mini-batch update, {len(jax.devices())} "
        f"{jax.devices()[0].platform} devices, {args.batch} rows a micro-batch at most")
  print(f"  {'workload':<11}{'way':<8}{'micro-batches':>14}{'padding':>9}{'trained tok/s':>15}")
  for name, r in runs.items():
    for way in ("padded", "packed"):
      w = r[way]
      print(f"  {name:<11}{way:<8}{w['micro_batches']:>14}{w['padding_fraction']:>9.3f}"
            f"{w['trained_tokens_per_s']:>15.0f}")
    print(f"  {name:<11}packing.speedup {r['speedup']:.2f}, packing.padding_fraction "
          f"{r['padding_fraction']:.3f}")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
