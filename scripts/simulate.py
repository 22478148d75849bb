"""Sweeps the in-flight window for every admission x dispatch policy and reports the
headline.

  python scripts/simulate.py --gin_file configs/sim/paper_text.gin --out runs/sim
  python scripts/simulate.py ... --seeds 0,1,2,3,4   # the reduction over seeds too

Writes OUT/summary.json (headline at matched throughput, per-policy figures; the
reduction with train_batch at W = G, 2G and 4G, `reduction_by_baseline_window`, for
the config's seed and, with --seeds, its mean and range over those seeds),
OUT/frontier.json (every sweep point of the config's seed) and
OUT/operative_config.gin; prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import gin

from knittrans_jax import cli, gin_cli
from knittrans_jax.sim import SimConfig
from knittrans_jax.sim.sweep import (COMBOS, headline, over_seeds, reduction_by_window,
                                     runs_below_bound, sweep_points, window_grid)


@gin.configurable
def sweep(out: str, policies=COMBOS, windows=None, workers=None, match_tolerance=0.0,
          refine_steps=5, seeds=()) -> dict:
  """seeds: more seeds to read `reduction_by_baseline_window` on (each a full sweep)."""
  config = SimConfig()
  t0 = time.perf_counter()
  windows = list(windows) if windows else window_grid(config)
  summaries = sweep_points(config, policies, windows, workers, match_tolerance, refine_steps,
                      f"seed {config.seed}")
  by_window = reduction_by_window(summaries, config, match_tolerance)
  by_seed = {config.seed: by_window}
  below = {config.seed: runs_below_bound(summaries, config)}
  for seed in seeds:
    if seed != config.seed:
      other = config.replace(seed=seed)
      points = sweep_points(other, policies, windows, workers, match_tolerance, refine_steps,
                       f"seed {seed}")
      by_seed[seed] = reduction_by_window(points, other, match_tolerance)
      below[seed] = runs_below_bound(points, other)
  stalled = [(s["policy"], s["window"]) for s in summaries if s["stalled"]]
  if stalled:
    print(f"stalled (window too small for the constraints): {stalled}")
  head = headline(summaries, config, match_tolerance)
  colocated = next(s for s in summaries if s["mode"] == "colocated")
  keys = ("admission", "dispatch", "reduction", "fraction_of_counterfactual",
          "counterfactual_reduction", "fraction_of_bound",
          "arch_floor_mean", "window", "arch_staleness_mean", "arch_staleness_signed_mean", "arch_staleness_p99",
          "arch_staleness_max", "quota_violations", "throughput_traj_per_s", "matched",
          "trainer_idle_frac", "rollout_idle_frac", "staleness_mean", "rollout_versions_mean",
          "rollout_s_mean", "sojourn_s_mean")
  summary = {
      "reduction_vs_train_batch": head["reduction_vs_train_batch"],
      "best": head["best"],
      # The same run's groups trained the moment they finished: not a lower bound.
      "counterfactual_reduction": head["counterfactual_reduction"],
      "fraction_of_counterfactual": head["fraction_of_counterfactual"],
      "reduction_same_window": head["reduction_same_window"],
      # Policy-independent: the least staleness any policy at the baseline's
      # throughput can have (metrics.staleness_bound) and the reduction it allows.
      "bound": head["bound"], "bound_reduction": head["bound_reduction"],
      "fraction_of_bound": head["fraction_of_bound"],
      "runs_below_bound": {str(k): v for k, v in below.items()},
      "reduction_by_baseline_window": by_window,
      "reduction_by_baseline_window_over_seeds": over_seeds(by_seed) if len(by_seed) > 1 else None,
      "seeds": sorted(by_seed),
      "baseline_window": head["baseline_window"],
      "baseline_throughput_traj_per_s": head["baseline_throughput_traj_per_s"],
      "match_tolerance": match_tolerance,
      "policies": {name: {k: pt[k] for k in keys} for name, pt in head["policies"].items()},
      "colocated": {k: colocated[k] for k in ("throughput_traj_per_s", "arch_staleness_mean",
                                              "trainer_idle_frac", "rollout_idle_frac")},
      "G": config.spec.groups_per_batch, "M": config.spec.num_mini_batches,
      "n": config.spec.group_size, "train_batches": config.train_batches,
      "wall_s": time.perf_counter() - t0,
  }
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=float)
  with open(os.path.join(out, "frontier.json"), "w") as f:
    json.dump(summaries, f, indent=1, default=float)

  print(f"\nmatched throughput: train_batch at W = 2G = {head['baseline_window']} gives "
        f"{head['baseline_throughput_traj_per_s']:.1f} traj/s")
  print(f"  {'admission + dispatch':<36}{'W':>6}{'traj/s':>9}{'a mean':>9}{'cf.':>7}"
        f"{'reduction':>11}{'of cf.':>10}{'p99':>6}{'quota viol.':>13}")
  for name, pt in summary["policies"].items():
    flag = "" if pt["matched"] else "  (never matched)"
    red = "-" if name == "train_batch" else f"{pt['reduction']:.3f}"
    frac = "-" if name == "train_batch" else f"{pt['fraction_of_counterfactual']:.2f}"
    print(f"  {name:<36}{pt['window']:>6}{pt['throughput_traj_per_s']:>9.1f}"
          f"{pt['arch_staleness_mean']:>9.2f}{pt['arch_floor_mean']:>7.2f}{red:>11}{frac:>10}"
          f"{pt['arch_staleness_p99']:>6.0f}{pt['quota_violations']:>13}{flag}")
  print(f"  colocated: {colocated['throughput_traj_per_s']:.1f} traj/s, a = 0")
  red, same = summary["reduction_vs_train_batch"], summary["reduction_same_window"]
  print(f"reduction vs train_batch (matched throughput, best quota-keeping: {summary['best']}): "
        f"{red:.3f} = {summary['fraction_of_counterfactual']:.2f} of its per-run counterfactual "
        f"{summary['counterfactual_reduction']:.3f} (cf.: not a lower bound); "
        f"constraint_preserving at the same W = 2G: {same:.3f}")
  print(f"policy-independent bound at the baseline's throughput: a >= {summary['bound']:.2f}, "
        f"so no policy reduces staleness by more than {summary['bound_reduction']:.3f}; "
        f"{summary['best']} reaches {summary['fraction_of_bound']:.2f} of that; sweep points "
        f"below the bound: {sum(len(v) for v in below.values())}")
  for key, r in by_window.items():
    line = (f"  train_batch at W = {key} = {r['window']}: reduction {r['reduction']:.3f} "
            f"({r['best']}), same window {r['reduction_same_window']:.3f}, "
            f"bound {r['bound_reduction']:.3f}"
            if r["reduction"] is not None else f"  train_batch at W = {key}: no match")
    seeds_r = (summary["reduction_by_baseline_window_over_seeds"] or {}).get(key)
    if seeds_r:
      line += (f"; seeds {summary['seeds']}: mean {seeds_r['mean']:.3f} "
               f"[{seeds_r['min']:.3f}, {seeds_r['max']:.3f}]")
    print(line)
  print(f"wall {summary['wall_s']:.1f} s")
  return summary


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_flags(parser)
  parser.add_argument("--out", default="runs/sim", help="output directory")
  parser.add_argument("--seeds", default="", help="comma-separated seeds to read the reduction "
                      "by baseline window on too (a full sweep each), e.g. 0,1,2,3,4")
  args = parser.parse_args()
  args.workdir = args.workdir or args.out
  cli.parse(args)
  seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
  if cli.check_only(args):
    return
  sweep(args.out, seeds=seeds)
  gin_cli.save_operative_config(args.out)


if __name__ == "__main__":
  main()
