"""Decision latency of `admit` at paper scale.

  python scripts/bench_admission.py --json runs/bench_admission.json

G = 512 groups of n = 8 (4096 trajectories) per train batch, M = 16, four sources
with exact quotas and per-mini-batch bounds. Rollout keeps W = 2G groups in flight;
groups finish in random order (lognormal durations per source) and each finish
is followed by admit() calls until one returns None, every call timed. Dispatch
follows short_sources(), as a controller would. Reports p50/p99/max per policy.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import statistics
import time

from tqdm import tqdm

from knittrans_jax import cli
from knittrans_jax.admission import GroupInfo, TrainBatchSpec, make_policy

# source: (share of a train batch in sixteenths, lognormal sigma of rollout time)
SOURCES = {"math": (5, 0.4), "code": (5, 0.9), "chat": (4, 0.6), "vqa": (2, 0.5)}
MEDIAN_TOKENS = {"math": 800, "code": 3000, "chat": 1500, "vqa": 1200}


def make_spec(G=512, n=8, M=16):
  """Quotas in proportion to the shares; bounds about +-40% around each share of g."""
  g = G // M
  quota = {s: G * share // 16 for s, (share, _) in SOURCES.items()}
  quota["math"] += G - sum(quota.values())
  bounds = {}
  for s, (share, _) in SOURCES.items():
    mean = g * share / 16
    bounds[s] = (int(mean * 0.6), min(g, int(mean * 1.4) + 1))
  return TrainBatchSpec(group_size=n, groups_per_batch=G, num_mini_batches=M,
                        source_quota=quota, mini_batch_bounds=bounds)


def run(policy_name: str, spec: TrainBatchSpec, train_batches: int, seed: int) -> dict:
  rng = random.Random(seed)
  policy = make_policy(policy_name, spec)
  W = 2 * spec.groups_per_batch
  quota = spec.source_quota
  cycle = [s for s, q in quota.items() for _ in range(q)]
  rng.shuffle(cycle)
  heap, now, next_id, version, dispatch_at = [], 0.0, 0, 0, 0
  latencies, admitted_groups = [], 0
  target = train_batches * spec.groups_per_batch

  def dispatch(source):
    nonlocal next_id
    policy.dispatched(source)
    dur = rng.lognormvariate(0, SOURCES[source][1])
    tokens = int(spec.group_size * MEDIAN_TOKENS[source] * rng.lognormvariate(0, 0.5))
    heapq.heappush(heap, (now + dur, next_id, source, tokens, version))
    next_id += 1

  for _ in range(W):
    dispatch(cycle[dispatch_at % len(cycle)])
    dispatch_at += 1
  bar = tqdm(total=target, desc=policy_name, unit="group", leave=False)
  while admitted_groups < target:
    now, gid, source, tokens, v = heapq.heappop(heap)
    policy.finished(GroupInfo(gid, source, tokens, v, rewards=(0.0, 1.0)))
    while True:
      t0 = time.perf_counter_ns()
      mb = policy.admit(version)
      latencies.append((time.perf_counter_ns() - t0) / 1e3)
      if mb is None:
        break
      version += 1
      admitted_groups += len(mb.groups)
      bar.update(len(mb.groups))
      for _ in mb.groups:  # keep W in flight; short sources first
        short = policy.short_sources()
        dispatch(short[0] if short else cycle[dispatch_at % len(cycle)])
        dispatch_at += 1
  bar.close()
  lat = sorted(latencies)
  return {"admit_calls": len(lat), "admit_p50_us": statistics.median(lat),
          "admit_p99_us": lat[int(0.99 * (len(lat) - 1))], "admit_max_us": lat[-1],
          "admit_mean_us": statistics.fmean(lat)}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True)
  parser.add_argument("--train_batches", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--G", type=int, default=512)
  parser.add_argument("--M", type=int, default=16)
  cli.add_check_flag(parser)
  args = parser.parse_args()
  spec = make_spec(G=args.G, M=args.M)
  if cli.check_only(args):
    return
  results = {name: run(name, spec, args.train_batches, args.seed)
             for name in ("constraint_preserving", "train_batch", "fifo")}
  out = dict(results["constraint_preserving"])  # the headline keys are ours
  out.update({"policies": results, "G": spec.groups_per_batch, "n": spec.group_size,
              "M": spec.num_mini_batches, "sources": len(SOURCES), "cpu_count": os.cpu_count()})
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"\nadmit() latency, G={spec.groups_per_batch} n={spec.group_size} "
        f"M={spec.num_mini_batches}, {len(SOURCES)} sources with quotas and bounds (us)")
  print(f"  {'policy':<24}{'calls':>8}{'p50':>10}{'p99':>10}{'max':>10}")
  for name, r in results.items():
    print(f"  {name:<24}{r['admit_calls']:>8}{r['admit_p50_us']:>10.1f}"
          f"{r['admit_p99_us']:>10.1f}{r['admit_max_us']:>10.1f}")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
