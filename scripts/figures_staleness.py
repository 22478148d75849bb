"""The staleness figures, from the simulator (configs/sim/paper_text.gin): the
staleness-throughput frontier, the CDF at matched throughput, and the sensitivity
of the reduction to M, the code source's tail and the trainer/rollout speed ratio
(scripts/reproduce_figures.py --only staleness)."""
from __future__ import annotations

import dataclasses
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from knittrans_jax.admission import TrainBatchSpec  # noqa: E402
from knittrans_jax.sim import SimConfig, simulate  # noqa: E402
from knittrans_jax.sim.sweep import (COMBOS, headline, over_seeds, reduction_by_window,  # noqa: E402
                                     refine, run_points, runs_below_bound, split, sweep_points,
                                     window_grid)

COLORS = {"train_batch": "tab:red", "fifo": "tab:gray", "constraint_preserving": "tab:blue"}
DASHES = {"shuffled": "-", "quota_aware": "--"}  # dispatch policy: line style


def style(name: str) -> tuple[str, str]:
  admission, dispatch = split(name)
  return COLORS[admission], DASHES.get(dispatch, ":")


def sweep(config: SimConfig, refine_steps: int = 5, up_to: int = 3):
  """The window sweep and its headline (train_batch at W = 2G). With up_to = 4 the
  grid reaches 4G and the matched points are bisected against every baseline
  window (reduction_by_window reads G, 2G and 4G from it)."""
  if up_to >= 4:
    summaries = sweep_points(config, COMBOS, window_grid(config, up_to=up_to),
                             refine_steps=refine_steps, desc=f"seed {config.seed}")
    return summaries, headline(summaries, config)
  G = config.spec.groups_per_batch
  points = [(p, w, "disaggregated") for p in COMBOS for w in window_grid(config, up_to=up_to)
            if split(p)[0] != "train_batch" or w >= G]
  points.append(("train_batch", None, "colocated"))
  summaries = [s for s, _ in run_points(config, points)]
  summaries += refine(summaries, config, COMBOS, 0.0, refine_steps)
  return summaries, headline(summaries, config)


def frontier_figure(summaries, head, colocated, path):
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for name in COMBOS:
    pts = sorted((p["window"], p) for p in summaries if p["policy"] == name
                 and p["mode"] == "disaggregated" and not p["stalled"])
    x = [p["throughput_traj_per_s"] for _, p in pts]
    y = [p["arch_staleness_mean"] for _, p in pts]
    color, ls = style(name)
    ax.plot(x, y, "o", ls=ls, ms=3, color=color, label=name)
    m = head["policies"][name]
    ax.plot(m["throughput_traj_per_s"], m["arch_staleness_mean"], "*", ms=14, color=color)
    ax.plot(m["throughput_traj_per_s"], m["arch_floor_mean"], "_", ms=14, mew=2, color=color)
  ax.plot(colocated["throughput_traj_per_s"], 0, "s", color="k", label="colocated (a = 0)")
  ax.axvline(head["baseline_throughput_traj_per_s"], ls=":", color="tab:red", lw=1)
  ax.set_xlabel("throughput (trajectories / s)")
  ax.set_ylabel("architectural staleness, mean of max(a, 0)")
  ax.set_title("Staleness-throughput frontier (W swept); *: matched point, -: its per-run counterfactual",
               fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def cdf_figure(config, head, path):
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  out = {}
  for name in COMBOS:
    w = head["policies"][name]["window"]
    admission, dispatch = split(name)
    a = np.sort(np.maximum(simulate(config, admission, w, dispatch=dispatch).arch, 0))
    color, ls = style(name)
    ax.step(a, np.arange(1, a.size + 1) / a.size, where="post", color=color, ls=ls,
            label=f"{name} (W = {w})")
    out[name] = {"window": w, **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}
  ax.set_xlabel("architectural staleness max(a, 0) (versions)")
  ax.set_ylabel("fraction of trajectories")
  ax.set_title("CDF at matched throughput")
  ax.legend(fontsize=7)
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


def sensitivity(config, train_batches, bar, ends_only: bool = False):
  """Reduction (constraint_preserving and fifo) along three axes, one sweep per point;
  `ends_only` (--quick): each axis's first and last value."""
  base = config.replace(train_batches=train_batches)
  axes = {
      "M": [(m, _variant(base, spec={"num_mini_batches": m})) for m in (4, 8, 16, 32)],
      "code tail sigma": [(s, _variant(base, sources={
          **{k: v for k, v in base.sources.items()},
          "code": dataclasses.replace(base.sources["code"], sigma=s)}))
                          for s in (0.5, 1.0, 1.5)],
      "trainer/rollout time ratio": [(r, base.replace(
          trainer_per_token_s=base.trainer_per_token_s * r, trainer_fixed_s=base.trainer_fixed_s * r))
                                     for r in (0.25, 1, 4, 16)],
  }
  results = {}
  if ends_only:
    axes = {axis: [variants[0], variants[-1]] for axis, variants in axes.items()}
  for axis, variants in axes.items():
    rows = []
    for value, cfg in variants:
      summaries, head = sweep(cfg, refine_steps=4)
      pol = head["policies"]
      rows.append({"value": value,
                   "reduction_constraint_preserving": pol["constraint_preserving"]["reduction"],
                   "reduction_quota_aware": pol["constraint_preserving+quota_aware"]["reduction"],
                   "fraction_of_counterfactual_quota_aware":
                       pol["constraint_preserving+quota_aware"]["fraction_of_counterfactual"],
                   "reduction_fifo": pol["fifo"]["reduction"],
                   "fifo_quota_violations": pol["fifo"]["quota_violations"]})
      bar.update()
    results[axis] = rows
  return results


def sensitivity_figure(results, path):
  fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), sharey=True)
  for ax, (axis, rows) in zip(axes, results.items()):
    x = [r["value"] for r in rows]
    ax.plot(x, [r["reduction_constraint_preserving"] for r in rows], "o-",
            color=COLORS["constraint_preserving"], label="constraint_preserving")
    ax.plot(x, [r["reduction_quota_aware"] for r in rows], "s--",
            color=COLORS["constraint_preserving"], label="constraint_preserving+quota_aware")
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


def staleness(out: str, sensitivity_batches: int, seeds=(0, 1, 2, 3, 4),
              train_batches: int | None = None) -> dict:
  """`train_batches` (--quick) shortens the main sweeps (default: the config's) and
  keeps each sensitivity axis's two ends."""
  config = SimConfig()
  if train_batches:
    config = config.replace(train_batches=train_batches)
  bar = tqdm(total=7 if train_batches else 12, desc="staleness figures",
             unit="sweep")  # 1 + the sensitivity points
  summaries, head = sweep(config, up_to=4)
  bar.update()
  by_seed = {config.seed: reduction_by_window(summaries, config)}
  below = {config.seed: runs_below_bound(summaries, config)}
  for seed in seeds:  # the reduction at each baseline window, over seeds
    if seed != config.seed:
      other = config.replace(seed=seed)
      points, _ = sweep(other, up_to=4)
      by_seed[seed] = reduction_by_window(points, other)
      below[seed] = runs_below_bound(points, other)
  colocated = next(p for p in summaries if p["mode"] == "colocated")
  frontier_figure(summaries, head, colocated, os.path.join(out, "staleness_frontier.png"))
  cdf = cdf_figure(config, head, os.path.join(out, "staleness_cdf.png"))
  sens = sensitivity(config, sensitivity_batches, bar, ends_only=bool(train_batches))
  sensitivity_figure(sens, os.path.join(out, "staleness_sensitivity.png"))
  bar.close()
  return {"headline": {k: v for k, v in head.items() if k != "policies"},
          "reduction_by_baseline_window": by_seed[config.seed],
          "reduction_by_baseline_window_over_seeds": over_seeds(by_seed), "seeds": sorted(by_seed),
          "runs_below_bound": {str(k): v for k, v in below.items()},
          "matched": {n: {k: p[k] for k in ("window", "throughput_traj_per_s", "arch_staleness_mean",
                                            "arch_staleness_signed_mean", "arch_staleness_p99",
                                            "quota_violations", "arch_floor_mean", "reduction",
                                            "fraction_of_counterfactual", "admission", "dispatch")}
                      for n, p in head["policies"].items()},
          "colocated_throughput": colocated["throughput_traj_per_s"], "cdf": cdf,
          "sensitivity": sens}


def staleness_section(s) -> list[str]:
  h = s["headline"]
  lines = ["## Staleness (simulator)", "",
           "![frontier](staleness_frontier.png)", "",
           f"Baseline: train_batch at W = 2G = {h['baseline_window']} gives "
           f"{h['baseline_throughput_traj_per_s']:.2f} trajectories/s. Each policy at the smallest "
           "window reaching that throughput:", "",
           "| admission + dispatch | W | traj/s | mean max(a,0) | per-run counterfactual | "
           "reduction | fraction of counterfactual | p99 | quota violations |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name, p in s["matched"].items():
    red = "" if name == "train_batch" or p.get("reduction") is None else f"{p['reduction']:.3f}"
    frac = ("" if name == "train_batch" or p.get("fraction_of_counterfactual") is None
            else f"{p['fraction_of_counterfactual']:.2f}")
    lines.append(f"| {name} | {p['window']} | {p['throughput_traj_per_s']:.2f} | "
                 f"{p['arch_staleness_mean']:.2f} | {p.get('arch_floor_mean', float('nan')):.2f} | "
                 f"{red} | {frac} | {p['arch_staleness_p99']:.0f} | {p['quota_violations']} |")
  lines += ["", f"Reduction vs train_batch at matched throughput, best quota-keeping "
            f"combination ({h.get('best')}): **{h['reduction_vs_train_batch']:.3f}**, "
            f"{h.get('fraction_of_counterfactual') or float('nan'):.2f} of its per-run "
            f"counterfactual {h.get('counterfactual_reduction') or float('nan'):.3f} (the same "
            "run's groups trained the moment they finished: not a lower bound, other policies "
            "go below it); constraint_preserving at the "
            f"same window W = 2G: {h['reduction_same_window']:.3f}. Colocated: "
            f"{s['colocated_throughput']:.2f} traj/s.", "",
            f"Policy-independent bound (`sim/metrics.staleness_bound`: each trajectory's own "
            f"decode time at the baseline's throughput, an evenly stepping trainer): a >= "
            f"{h['bound']:.2f}, so no policy reduces staleness by more than "
            f"**{h['bound_reduction']:.3f}**; {h.get('best')} reaches "
            f"{h['fraction_of_bound']:.2f} of that. Sweep points below the bound: "
            f"{sum(len(v) for v in s.get('runs_below_bound', {}).values())}.", "",
            "The baseline's window (best quota-keeping combination at matched throughput, "
            f"seeds {s.get('seeds')}):", "",
            "| train_batch's window | reduction, seed 0 | mean over seeds [range] | "
            "bound_reduction (mean) | constraint_preserving at the same window, seed 0 |",
            "| --- | --- | --- | --- | --- |"]
  over = s.get("reduction_by_baseline_window_over_seeds", {})
  for key, r in s.get("reduction_by_baseline_window", {}).items():
    o = over.get(key, {})
    b = o.get("bound_reduction", {})
    lines.append(f"| W = {key} = {r['window']} | {r['reduction']:.3f} | {o.get('mean', float('nan')):.3f} "
                 f"[{o.get('min', float('nan')):.3f}, {o.get('max', float('nan')):.3f}] | "
                 f"{b.get('mean', float('nan')):.3f} | {r['reduction_same_window']:.3f} |")
  lines += ["", "![cdf](staleness_cdf.png)", "",
            "| policy | W | p50 | p90 | p99 |", "| --- | --- | --- | --- | --- |"]
  for name, c in s["cdf"].items():
    lines.append(f"| {name} | {c['window']} | {c['p50']:.0f} | {c['p90']:.0f} | {c['p99']:.0f} |")
  lines += ["", "![sensitivity](staleness_sensitivity.png)", ""]
  for axis, rows in s["sensitivity"].items():
    lines += [f"Reduction vs {axis}:", "", "| value | constraint_preserving | "
              "constraint_preserving+quota_aware (of counterfactual) | fifo | fifo quota violations |",
              "| --- | --- | --- | --- | --- |"]
    for r in rows:
      qa = r.get("reduction_quota_aware")
      qa = "" if qa is None else f"{qa:.3f} ({r['fraction_of_counterfactual_quota_aware']:.2f})"
      lines.append(f"| {r['value']} | {r['reduction_constraint_preserving']:.3f} | {qa} | "
                   f"{r['reduction_fifo']:.3f} | {r['fifo_quota_violations']} |")
    lines.append("")
  return lines
