"""Sweeps the in-flight window for every admission x dispatch policy and reports the
headline.

  python scripts/simulate.py --gin_file configs/sim/paper_text.gin --out runs/sim

Writes OUT/summary.json (headline at matched throughput, per-policy figures),
OUT/frontier.json (every sweep point) and OUT/operative_config.gin; prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import gin
from tqdm import tqdm

from knittrans_jax import gin_cli
from knittrans_jax.sim import SimConfig
from knittrans_jax.sim.sweep import COMBOS, headline, refine, run_points, split, window_grid


@gin.configurable
def sweep(out: str, policies=COMBOS, windows=None, workers=None, match_tolerance=0.0,
          refine_steps=5) -> dict:
  config = SimConfig()
  t0 = time.perf_counter()
  windows = list(windows) if windows else window_grid(config)
  G = config.spec.groups_per_batch
  # train_batch needs a whole train batch in flight: W >= G.
  points = [(p, w, "disaggregated") for p in policies for w in windows
            if split(p)[0] != "train_batch" or w >= G]
  points.append(("train_batch", None, "colocated"))
  with tqdm(total=len(points), desc="simulating", unit="run") as bar:
    results = run_points(config, points, workers, progress=bar.update)
  summaries = [s for s, _ in results]
  if refine_steps:
    summaries += refine(summaries, config, policies, match_tolerance, refine_steps, workers)
  stalled = [(s["policy"], s["window"]) for s in summaries if s["stalled"]]
  if stalled:
    print(f"stalled (window too small for the constraints): {stalled}")
  head = headline(summaries, config, match_tolerance)
  colocated = next(s for s in summaries if s["mode"] == "colocated")
  keys = ("admission", "dispatch", "reduction", "fraction_of_floor", "floor_reduction",
          "arch_floor_mean", "window", "arch_staleness_mean", "arch_staleness_signed_mean", "arch_staleness_p99",
          "arch_staleness_max", "quota_violations", "throughput_traj_per_s", "matched",
          "trainer_idle_frac", "rollout_idle_frac", "staleness_mean", "rollout_versions_mean",
          "rollout_s_mean", "sojourn_s_mean")
  summary = {
      "reduction_vs_train_batch": head["reduction_vs_train_batch"],
      "best": head["best"],
      "decode_floor_reduction": head["decode_floor_reduction"],
      "fraction_of_floor": head["fraction_of_floor"],
      "reduction_same_window": head["reduction_same_window"],
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
  print(f"  {'admission + dispatch':<36}{'W':>6}{'traj/s':>9}{'a mean':>9}{'floor':>7}"
        f"{'reduction':>11}{'of floor':>10}{'p99':>6}{'quota viol.':>13}")
  for name, pt in summary["policies"].items():
    flag = "" if pt["matched"] else "  (never matched)"
    red = "-" if name == "train_batch" else f"{pt['reduction']:.3f}"
    frac = "-" if name == "train_batch" else f"{pt['fraction_of_floor']:.2f}"
    print(f"  {name:<36}{pt['window']:>6}{pt['throughput_traj_per_s']:>9.1f}"
          f"{pt['arch_staleness_mean']:>9.2f}{pt['arch_floor_mean']:>7.2f}{red:>11}{frac:>10}"
          f"{pt['arch_staleness_p99']:>6.0f}{pt['quota_violations']:>13}{flag}")
  print(f"  colocated: {colocated['throughput_traj_per_s']:.1f} traj/s, a = 0")
  red, same = summary["reduction_vs_train_batch"], summary["reduction_same_window"]
  print(f"reduction vs train_batch (matched throughput, best quota-keeping: {summary['best']}): "
        f"{red:.3f} = {summary['fraction_of_floor']:.2f} of its decode floor "
        f"{summary['decode_floor_reduction']:.3f}; constraint_preserving at the same W = 2G: "
        f"{same:.3f}; wall {summary['wall_s']:.1f} s")
  return summary


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  gin_cli.add_flags(parser)
  parser.add_argument("--out", default="runs/sim", help="output directory")
  args = parser.parse_args()
  args.workdir = args.workdir or args.out
  gin_cli.parse(args)
  sweep(args.out)
  gin_cli.save_operative_config(args.out)


if __name__ == "__main__":
  main()
