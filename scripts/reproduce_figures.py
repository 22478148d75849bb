"""Reproduces the paper's figures: PNGs plus the numbers behind them.

  python scripts/reproduce_figures.py --only staleness --out figures/

staleness (simulator, configs/sim/paper_text.gin):
  staleness_frontier.png   architectural staleness against throughput, per policy
  staleness_cdf.png        CDF of max(a, 0) per policy at the matched-throughput point
  staleness_sensitivity.png  reduction vs M, vs the code source's tail weight, and vs
                           the rollout/trainer speed ratio
figures/summary.md holds every number drawn. Other figure groups come with later work.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import gin
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from knittrans_jax import gin_cli  # noqa: E402
from knittrans_jax.admission import TrainBatchSpec  # noqa: E402
from knittrans_jax.sim import SimConfig, simulate  # noqa: E402
from knittrans_jax.sim.sweep import POLICIES, headline, refine, run_points, window_grid  # noqa: E402

COLORS = {"train_batch": "tab:red", "fifo": "tab:gray", "constraint_preserving": "tab:blue"}


def sweep(config: SimConfig, refine_steps: int = 5):
  G = config.spec.groups_per_batch
  points = [(p, w, "disaggregated") for p in POLICIES for w in window_grid(config)
            if p != "train_batch" or w >= G]
  points.append(("train_batch", None, "colocated"))
  summaries = [s for s, _ in run_points(config, points)]
  summaries += refine(summaries, config, POLICIES, 0.0, refine_steps)
  return summaries, headline(summaries, config)


def frontier_figure(summaries, head, colocated, path):
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for name in POLICIES:
    pts = sorted((p["window"], p) for p in summaries if p["policy"] == name
                 and p["mode"] == "disaggregated" and not p["stalled"])
    x = [p["throughput_traj_per_s"] for _, p in pts]
    y = [p["arch_staleness_mean"] for _, p in pts]
    ax.plot(x, y, "o-", ms=3, color=COLORS[name], label=name)
    m = head["policies"][name]
    ax.plot(m["throughput_traj_per_s"], m["arch_staleness_mean"], "*", ms=14, color=COLORS[name])
  ax.plot(colocated["throughput_traj_per_s"], 0, "s", color="k", label="colocated (a = 0)")
  ax.axvline(head["baseline_throughput_traj_per_s"], ls=":", color="tab:red", lw=1)
  ax.set_xlabel("throughput (trajectories / s)")
  ax.set_ylabel("architectural staleness, mean of max(a, 0)")
  ax.set_title("Staleness-throughput frontier (window W swept); stars: matched point")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def cdf_figure(config, head, path):
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  out = {}
  for name in POLICIES:
    w = head["policies"][name]["window"]
    a = np.sort(np.maximum(simulate(config, name, w).arch, 0))
    ax.step(a, np.arange(1, a.size + 1) / a.size, where="post", color=COLORS[name],
            label=f"{name} (W = {w})")
    out[name] = {"window": w, **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}
  ax.set_xlabel("architectural staleness max(a, 0) (versions)")
  ax.set_ylabel("fraction of trajectories")
  ax.set_title("CDF at matched throughput")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return out


def _variant(config, **changes):
  spec_changes = changes.pop("spec", {})
  spec = TrainBatchSpec(**{**{f: getattr(config.spec, f) for f in (
      "group_size", "groups_per_batch", "num_mini_batches", "source_quota",
      "mini_batch_bounds", "mini_batch_token_budget", "max_staleness", "drop_zero_signal")},
                           **spec_changes})
  return config.replace(spec=spec, **changes)


def sensitivity(config, train_batches, bar):
  """Reduction (constraint_preserving and fifo) along three axes, one sweep per point."""
  base = config.replace(train_batches=train_batches)
  axes = {
      "M": [(m, _variant(base, spec={"num_mini_batches": m})) for m in (4, 8, 16, 32)],
      "code tail sigma": [(s, _variant(base, sources={
          **{k: v for k, v in base.sources.items()},
          "code": __import__("dataclasses").replace(base.sources["code"], sigma=s)}))
                          for s in (0.5, 1.0, 1.5)],
      "trainer/rollout time ratio": [(r, base.replace(
          trainer_per_token_s=base.trainer_per_token_s * r, trainer_fixed_s=base.trainer_fixed_s * r))
                                     for r in (0.25, 1, 4, 16)],
  }
  results = {}
  for axis, variants in axes.items():
    rows = []
    for value, cfg in variants:
      summaries, head = sweep(cfg, refine_steps=4)
      fifo = head["policies"]["fifo"]
      rows.append({"value": value, "reduction_constraint_preserving": head["reduction_vs_train_batch"],
                   "reduction_fifo": 1 - fifo["arch_staleness_mean"] /
                   head["policies"]["train_batch"]["arch_staleness_mean"],
                   "fifo_quota_violations": fifo["quota_violations"]})
      bar.update()
    results[axis] = rows
  return results


def sensitivity_figure(results, path):
  fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), sharey=True)
  for ax, (axis, rows) in zip(axes, results.items()):
    x = [r["value"] for r in rows]
    ax.plot(x, [r["reduction_constraint_preserving"] for r in rows], "o-",
            color=COLORS["constraint_preserving"], label="constraint_preserving")
    ax.plot(x, [r["reduction_fifo"] for r in rows], "o--", color=COLORS["fifo"],
            label="fifo (breaks quotas)")
    ax.axhline(0.93, ls=":", color="k", lw=1)
    ax.set_xlabel(axis)
    if axis != "code tail sigma":
      ax.set_xscale("log", base=2)
  axes[0].set_ylabel("reduction vs train_batch at matched throughput")
  axes[0].legend(loc="lower right", fontsize=8)
  fig.suptitle("Where the staleness reduction grows and shrinks (dotted: 0.93)")
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def staleness(out: str, sensitivity_batches: int) -> dict:
  config = SimConfig()
  bar = tqdm(total=12, desc="staleness figures", unit="sweep")
  summaries, head = sweep(config)
  bar.update()
  colocated = next(p for p in summaries if p["mode"] == "colocated")
  frontier_figure(summaries, head, colocated, os.path.join(out, "staleness_frontier.png"))
  cdf = cdf_figure(config, head, os.path.join(out, "staleness_cdf.png"))
  sens = sensitivity(config, sensitivity_batches, bar)
  sensitivity_figure(sens, os.path.join(out, "staleness_sensitivity.png"))
  bar.close()
  return {"headline": {k: v for k, v in head.items() if k != "policies"},
          "matched": {n: {k: p[k] for k in ("window", "throughput_traj_per_s", "arch_staleness_mean",
                                            "arch_staleness_signed_mean", "arch_staleness_p99",
                                            "quota_violations")}
                      for n, p in head["policies"].items()},
          "colocated_throughput": colocated["throughput_traj_per_s"], "cdf": cdf,
          "sensitivity": sens}


def write_summary(out, numbers):
  lines = ["# Figures and the numbers behind them", "",
           "Made by `python scripts/reproduce_figures.py --only staleness --out figures/` "
           "(simulator, `configs/sim/paper_text.gin`).", ""]
  s = numbers["staleness"]
  h = s["headline"]
  lines += ["## Staleness (simulator)", "",
            "![frontier](staleness_frontier.png)", "",
            f"Baseline: train_batch at W = 2G = {h['baseline_window']} gives "
            f"{h['baseline_throughput_traj_per_s']:.2f} trajectories/s. Each policy at the smallest "
            "window reaching that throughput:", "",
            "| policy | W | traj/s | mean max(a,0) | signed mean | p99 | quota violations |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
  for name, p in s["matched"].items():
    lines.append(f"| {name} | {p['window']} | {p['throughput_traj_per_s']:.2f} | "
                 f"{p['arch_staleness_mean']:.2f} | {p['arch_staleness_signed_mean']:.2f} | "
                 f"{p['arch_staleness_p99']:.0f} | {p['quota_violations']} |")
  lines += ["", f"Reduction vs train_batch at matched throughput: "
            f"**{h['reduction_vs_train_batch']:.3f}**; at the same window W = 2G: "
            f"{h['reduction_same_window']:.3f}. Colocated: {s['colocated_throughput']:.2f} traj/s.",
            "", "![cdf](staleness_cdf.png)", "",
            "| policy | W | p50 | p90 | p99 |", "| --- | --- | --- | --- | --- |"]
  for name, c in s["cdf"].items():
    lines.append(f"| {name} | {c['window']} | {c['p50']:.0f} | {c['p90']:.0f} | {c['p99']:.0f} |")
  lines += ["", "![sensitivity](staleness_sensitivity.png)", ""]
  for axis, rows in s["sensitivity"].items():
    lines += [f"Reduction vs {axis}:", "", "| value | constraint_preserving | fifo | fifo quota violations |",
              "| --- | --- | --- | --- |"]
    for r in rows:
      lines.append(f"| {r['value']} | {r['reduction_constraint_preserving']:.3f} | "
                   f"{r['reduction_fifo']:.3f} | {r['fifo_quota_violations']} |")
    lines.append("")
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("\n".join(lines))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  gin_cli.add_flags(parser)
  parser.add_argument("--only", choices=["staleness"], default="staleness")
  parser.add_argument("--out", default="figures")
  parser.add_argument("--sensitivity_batches", type=int, default=10,
                      help="train batches per run in the sensitivity sweeps")
  args = parser.parse_args()
  if not args.gin_file:
    args.gin_file = ["configs/sim/paper_text.gin"]
  args.workdir = args.workdir or args.out
  gin_cli.parse(args)
  os.makedirs(args.out, exist_ok=True)
  t0 = time.perf_counter()
  numbers = {"staleness": staleness(args.out, args.sensitivity_batches)}
  numbers["wall_s"] = time.perf_counter() - t0
  with open(os.path.join(args.out, "numbers.json"), "w") as f:
    json.dump(numbers, f, indent=1, default=float)
  write_summary(args.out, numbers)
  gin_cli.save_operative_config(args.out)
  print(open(os.path.join(args.out, "summary.md")).read())


if __name__ == "__main__":
  main()
