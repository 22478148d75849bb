"""Reproduces the paper's figures: PNGs plus the numbers behind them.

  python scripts/reproduce_figures.py --out figures/            # every figure
  python scripts/reproduce_figures.py --quick --out /tmp/figs     # every figure, reduced size
  python scripts/reproduce_figures.py --only runs transfer        # some groups

staleness (simulator, configs/sim/paper_text.gin):
  staleness_frontier.png   architectural staleness against throughput, per policy
  staleness_cdf.png        CDF of max(a, 0) per policy at the matched-throughput point
  staleness_sensitivity.png  reduction vs M, vs the code source's tail weight, and vs
                           the rollout/trainer speed ratio
runs (scripts/train.py, configs/text_grpo_tiny.gin; colocated and one run per policy):
  runs_staleness.png       CDF of measured architectural staleness per run
  learning_curves.png      reward per optimizer step per run
learning (scripts/study.py, configs/study/staleness.gin; 5 seeds per configuration):
  study_learning_curves.png  held-out reward of the current policy, mean and 95% band
  study_dose_response.png    final reward against mean architectural staleness
transfer (scripts/bench_transfer.py, text and vlm):
  transfer_latency.png     exposed and raw transfer latency, baseline vs on-demand
multimodal (scripts/bench_multimodal.py):
  multimodal_step.png      transfer + training per mini-batch: baseline, both
                           ablations, knittrans
figures/summary.md holds every number drawn, and numbers.json all of them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from knittrans_jax import gin_cli  # noqa: E402
from knittrans_jax.admission import TrainBatchSpec  # noqa: E402
from knittrans_jax.sim import SimConfig, simulate  # noqa: E402
from knittrans_jax.sim.sweep import (COMBOS, headline, over_seeds, reduction_by_window,  # noqa: E402
                                     refine, run_points, runs_below_bound, split, sweep_points,
                                     window_grid)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def staleness(out: str, sensitivity_batches: int, seeds=(0, 1, 2, 3, 4)) -> dict:
  config = SimConfig()
  bar = tqdm(total=12, desc="staleness figures", unit="sweep")  # 1 + 11 sensitivity points
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
  sens = sensitivity(config, sensitivity_batches, bar)
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


# -- real tiny runs: staleness per policy and learning curves -------------------
# name: gin bindings on configs/text_grpo_tiny.gin (G = 16 groups per train batch).
# The window W (groups dispatched, not yet trained) sets the pipeline depth: at one
# W every policy has about the same staleness (Little's law); what early admission
# buys is reaching the baseline's throughput with a smaller W, as in the simulator.
RUNS = {
    "colocated": ["JobConfig.mode = 'colocated'"],
    "train_batch W=2G": ["JobConfig.policy = 'train_batch'", "JobConfig.window = 32"],
    "constraint_preserving W=2G": ["JobConfig.policy = 'constraint_preserving'",
                                   "JobConfig.window = 32"],
    "constraint_preserving W=G": ["JobConfig.policy = 'constraint_preserving'",
                                  "JobConfig.window = 16"],
    "constraint_preserving W=G/2": ["JobConfig.policy = 'constraint_preserving'",
                                    "JobConfig.window = 8"],
    "fifo W=G/2": ["JobConfig.policy = 'fifo'", "JobConfig.window = 8"],
    "constraint_preserving+quota_aware W=G/2": ["JobConfig.policy = 'constraint_preserving'",
                                                "JobConfig.window = 8",
                                                "JobConfig.dispatch = 'quota_aware'"],
}
# configs/text_grpo_tails.gin's long source and one group per worker call, where
# the sources' completion times differ (issue 16): the dispatch policies side by side.
TAILS = ["TrainBatchSpec.source_quota = {'nearest': 6, 'count': 5, 'chain_long': 5}",
         "JobConfig.groups_per_call = 1"]
RUNS.update({
    "tails: train_batch W=2G": [*TAILS, "JobConfig.policy = 'train_batch'", "JobConfig.window = 32"],
    "tails: constraint_preserving W=G/2": [*TAILS, "JobConfig.policy = 'constraint_preserving'",
                                           "JobConfig.window = 8"],
    "tails: constraint_preserving+quota_aware W=G/2": [
        *TAILS, "JobConfig.policy = 'constraint_preserving'", "JobConfig.window = 8",
        "JobConfig.dispatch = 'quota_aware'"],
})
BASELINE_RUN = "train_batch W=2G"
RUN_STYLE = {"colocated": ("k", "-"), "train_batch W=2G": ("tab:red", "-"),
             "constraint_preserving W=2G": ("tab:blue", ":"),
             "constraint_preserving W=G": ("tab:blue", "--"),
             "constraint_preserving W=G/2": ("tab:blue", "-"), "fifo W=G/2": ("tab:gray", "-"),
             "constraint_preserving+quota_aware W=G/2": ("tab:cyan", "-"),
             "tails: train_batch W=2G": ("tab:red", ":"),
             "tails: constraint_preserving W=G/2": ("tab:blue", ":"),
             "tails: constraint_preserving+quota_aware W=G/2": ("tab:cyan", ":")}


def _subprocess(cmd, log_path, what):
  """Runs a script to completion, its output to `log_path`; a failure names the log."""
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  with open(log_path, "w") as log:
    code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
  if code:
    with open(log_path) as f:
      tail = "".join(f.readlines()[-20:])
    raise RuntimeError(f"{what} failed (exit {code}); {log_path} ends:\n{tail}")


QUICK_RUNS = ("colocated", "train_batch W=2G", "constraint_preserving W=G/2",
              "tails: train_batch W=2G", "tails: constraint_preserving+quota_aware W=G/2")


def real_runs(out: str, work: str, train_batches: int, matching: str | None = None,
              previous: dict | None = None, quick: bool = False) -> dict:
  """The default text job once per admission policy and colocated, side by side.
  `matching`: rerun only the runs whose name starts with it and keep the others'
  numbers from `previous` (the figures are redrawn from all of them)."""
  results = {}
  if matching is not None:
    if previous is None or previous.get("train_batches") != train_batches:
      raise ValueError(f"--runs_matching {matching!r} keeps the other runs' numbers, but "
                       f"figures/numbers.json has none at {train_batches} train batches")
    results = {k: v for k, v in previous["policies"].items()
               if k in RUNS and not k.startswith(matching)}
  todo = {k: v for k, v in RUNS.items() if (matching is None or k.startswith(matching))
          and (not quick or k in QUICK_RUNS)}
  if not todo:
    raise ValueError(f"--runs_matching {matching!r} matches none of {list(RUNS)}")
  bar = tqdm(todo.items(), desc="tiny runs", unit="run")
  for name, bindings in bar:
    bar.set_postfix(run=name)
    wd = os.path.join(work, "runs", name.replace(" ", "_").replace("/", "_"))
    os.makedirs(os.path.dirname(wd), exist_ok=True)
    cmd = [sys.executable, "scripts/train.py", "--gin_file", "configs/text_grpo_tiny.gin",
           "--workdir", wd, "--overwrite",
           "--gin_bindings", f"JobConfig.train_batches = {train_batches}",
           # Staleness and throughput are what these runs show; the learning study evaluates.
           "--gin_bindings", "EvalConfig.every_steps = 0"]
    for b in bindings:
      cmd += ["--gin_bindings", b]
    _subprocess(cmd, wd + ".log", f"the {name} run")
    results[name] = run_result(wd)
  results = {k: results[k] for k in RUNS if k in results}  # the table's order
  return {"train_batches": train_batches, "policies": runs_figures(results, out)}


def run_result(workdir: str) -> dict:
  """What the figures take from a finished job's metrics.jsonl and summary.json."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  arch = np.maximum(np.asarray([a for r in records for a in r["arch"]], dtype=int), 0)
  if arch.size == 0:
    raise ValueError(f"{workdir}: the run trained no step, so it has no staleness to plot")
  return {"steps": len(records), "wall_s": summary["wall_s"],
          "traj_per_s": summary["trajectories"] / summary["wall_s"],
          "quota_violations": summary["quota_violations"],
          "arch_mean": float(arch.mean()), "arch_p50": float(np.percentile(arch, 50)),
          "arch_p99": float(np.percentile(arch, 99)),
          "reward_first": summary["reward_first"], "reward_last": summary["reward_last"],
          "dispatch_estimates_s": summary.get("dispatch_estimates_s"),
          "reward": [r["reward"] for r in records], "arch_hist": np.bincount(arch).tolist()}


def runs_figures(results: dict, out: str) -> dict:
  """Both figures from {run name: run_result}; adds each run's reduction vs train_batch."""
  for name, r in results.items():  # against the train-batch run of the same task mix
    base = "tails: " + BASELINE_RUN if name.startswith("tails: ") else BASELINE_RUN
    tb = results.get(base, {}).get("arch_mean", 0)
    r["reduction_vs_train_batch"] = 1 - r["arch_mean"] / tb if tb > 0 else None
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  xmax = max(len(r["arch_hist"]) for r in results.values())
  for name, r in results.items():
    hist = np.asarray(r["arch_hist"], float)
    cdf = np.cumsum(hist) / hist.sum()
    # Carried on to the common right edge, so colocated (all at 0) shows as a line.
    color, ls = RUN_STYLE.get(name, ("tab:green", "-"))
    ax.step(np.append(np.arange(hist.size), xmax), np.append(cdf, cdf[-1]), where="post",
            color=color, ls=ls, lw=2.5 if name == "colocated" else 1.5,
            label=f"{name} (mean {r['arch_mean']:.2f})")
  ax.set_xlabel("architectural staleness max(a, 0) (versions)")
  ax.set_ylabel("fraction of trajectories")
  ax.set_title("Measured in tiny text runs (configs/text_grpo_tiny.gin)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "runs_staleness.png"), dpi=130)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for name, r in results.items():
    y = np.asarray(r["reward"])
    k = max(1, len(y) // 20)  # moving average over 5% of the run
    smooth = np.convolve(y, np.ones(k) / k, mode="valid")
    color, ls = RUN_STYLE.get(name, ("tab:green", "-"))
    ax.plot(np.arange(k, len(y) + 1), smooth, color=color, ls=ls, label=name)
  ax.set_xlabel("optimizer step")
  ax.set_ylabel("mean reward of the step's trajectories")
  ax.set_title("Learning curves (moving average)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "learning_curves.png"), dpi=130)
  plt.close(fig)
  return results


# -- learning: the study of staleness and learning quality (scripts/study.py) ------
def learning(out: str, work: str, quick: bool) -> dict:
  """Runs (or resumes) the study, copies its figures, returns the `learning` numbers."""
  study_out = os.path.join(work, "study_quick" if quick else "study")
  cmd = [sys.executable, "scripts/study.py", "--gin_file", "configs/study/staleness.gin",
         "--out", study_out]
  if quick:  # the machinery at a glance: 4 configurations x 2 seeds x 8 train batches
    cmd = [sys.executable, "scripts/study.py", "--gin_file", "configs/study/staleness_quick.gin",
           "--out", study_out]
  os.makedirs(study_out, exist_ok=True)
  _subprocess(cmd, os.path.join(study_out, "study.log"), "the learning study")
  with open(os.path.join(study_out, "results.json")) as f:
    res = json.load(f)
  for name in ("learning_curves.png", "dose_response.png"):
    if os.path.exists(os.path.join(study_out, name)):
      shutil.copy(os.path.join(study_out, name), os.path.join(out, "study_" + name))
  keep = ("seeds", "final_reward_mean", "final_reward_ci95", "arch_staleness_mean_mean",
          "traj_per_s_mean", "traj_per_s_ci95", "steps_to_threshold_mean",
          "steps_to_threshold_ci95", "train_s_to_threshold_mean", "reached_threshold",
          "quota_violations", "gap_closed", "gap_closed_ci95", "vs")
  configs = {}
  for name, s in res["summary"].items():
    c = {k: s[k] for k in keep if k in s}
    c["arch_staleness_mean"] = c.pop("arch_staleness_mean_mean", None)
    c["traj_per_s"] = c.pop("traj_per_s_mean", None)
    configs[name] = c
  return {"configurations": configs, "metric": res["metric"], "threshold": res["threshold"],
          "baseline": res["baseline"], "reference": res["reference"],
          "base_gin": res["base_gin"], "common_bindings": res["common_bindings"],
          "interval_method": res["interval_method"], "selection_seeds": res["selection_seeds"],
          "reported_seeds": res["reported_seeds"], "eval_train_overlap": res["eval_train_overlap"],
          "comparisons": {name: s["vs"] for name, s in res["summary"].items() if "vs" in s},
          "dose_response": res["dose_response"] and {
              k: res["dose_response"][k] for k in ("configurations", "per_configuration", "fit")},
          "table": study_table(res), "study_wall_s": res["wall_s"]}


def study_table(res) -> str:
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import study
  return study.table(res)


# -- transfer: centralized baseline vs on-demand, text and vlm ------------------
def transfer(out: str, work: str, quick: bool) -> dict:
  results = {}
  size = ["--prompts", "8", "--mini_batches", "2"] if quick else []
  for workload in tqdm(("text", "vlm"), desc="transfer bench", unit="workload"):
    path = os.path.join(work, f"bench_transfer_{workload}.json")
    _subprocess([sys.executable, "scripts/bench_transfer.py", "--workload", workload, "--json",
                 path, "--dir", os.path.join(work, f"transfer_{workload}"), *size],
                os.path.join(work, f"bench_transfer_{workload}.log"), f"bench_transfer {workload}")
    with open(path) as f:
      results[workload] = json.load(f)
  return transfer_figure(results, out)


def transfer_figure(benches: dict, out: str) -> dict:
  """transfer_latency.png from {workload: bench_transfer JSON}; returns its numbers."""
  results = {}
  sides = ("baseline", "prefetch", "ondemand")
  for workload, d in benches.items():
    side = {"baseline": d["baselines"]["centralized"],
            "prefetch": d["baselines"]["centralized_prefetch"], "ondemand": d["ondemand"]}
    results[workload] = {
        "trajectories": d["trajectories"], "consumers": d["consumers"],
        **{f"{name}_{k}": side[name][k] for name in sides
           for k in ("exposed_s", "raw_transfer_s", "total_s")},
        **{f"bytes_{name}": d["bytes_moved"][name] for name in sides},
        "exposed_ratio": d["exposed_ratio"], "raw_ratio": d["raw_ratio"],
        "prefetch_exposed_ratio": side["prefetch"]["exposed_ratio"],
        "total_ratio_vs_centralized": side["baseline"]["total_ratio"],
        "total_ratio": d["total_ratio"]}  # end to end, against the prefetching baseline
  fig, axes = plt.subplots(1, 3, figsize=(13, 4))
  workloads = list(results)
  colors = {"baseline": "tab:red", "prefetch": "tab:orange", "ondemand": "tab:blue"}
  labels = {"baseline": "centralized", "prefetch": "centralized + prefetch",
            "ondemand": "on-demand"}
  for ax, key, title in zip(axes, ("exposed_s", "raw_transfer_s", "total_s"),
                            ("exposed (the step waits)", "raw (moving the data)",
                             "total (transfer + training)")):
    x = np.arange(len(workloads))
    for i, side in enumerate(sides):
      vals = [results[w][f"{side}_{key}"] for w in workloads]
      ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=labels[side], color=colors[side])
    ax.set_xticks(x, workloads)
    if key != "total_s":
      ax.set_yscale("log")
    ax.set_ylabel("seconds, whole bench (max over consumers)")
    ax.set_title(title)
    ax.legend(fontsize=7)
  fig.suptitle("Centralized baselines vs on-demand reads (scripts/bench_transfer.py)")
  fig.tight_layout()
  fig.savefig(os.path.join(out, "transfer_latency.png"), dpi=130)
  plt.close(fig)
  return results


# -- multimodal: transfer + training per mini-batch with the ablations ----------
MM_VARIANTS = (("baseline", "baseline_s"), ("ondemand_only", "ondemand_only_s"),
               ("dedup_only", "dedup_only_s"), ("knittrans", "knittrans_s"))


def multimodal(out: str, work: str, quick: bool) -> dict:
  path = os.path.join(work, "bench_multimodal.json")
  size = ["--image", "224", "--prompts", "8"] if quick else []
  bar = tqdm(total=1, desc="multimodal bench", unit="run")
  _subprocess([sys.executable, "scripts/bench_multimodal.py", "--json", path,
               "--dir", os.path.join(work, "multimodal"), *size],
              os.path.join(work, "bench_multimodal.log"), "bench_multimodal")
  bar.update()
  bar.close()
  with open(path) as f:
    return multimodal_figure(json.load(f), out)


def multimodal_figure(d: dict, out: str) -> dict:
  """multimodal_step.png from a bench_multimodal JSON; returns its numbers."""
  per = {name: d[key] if key in d else d["ablation"][key] for name, key in MM_VARIANTS}
  exposed = d["exposed_s"]
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  names = [n for n, _ in MM_VARIANTS]
  exp = [exposed[n] for n in names]  # the bench reports both per mini-batch
  ax.bar(names, [per[n] - e for n, e in zip(names, exp)], color="tab:blue", label="compute")
  ax.bar(names, exp, bottom=[per[n] - e for n, e in zip(names, exp)], color="tab:red",
         label="exposed transfer")
  for i, n in enumerate(names):
    ax.text(i, per[n], f"{per['baseline'] / per[n]:.2f}x", ha="center", va="bottom")
  ax.set_ylabel("seconds per mini-batch (transfer + training)")
  c = d["config"]
  ax.set_title(f"VLM mini-batch: {c['prompts']} prompts x n = {c['n']}, {c['image']} px "
               "(scripts/bench_multimodal.py)", fontsize=9)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "multimodal_step.png"), dpi=130)
  plt.close(fig)
  return {"config": c, "seconds_per_mini_batch": per, "exposed_s_per_mini_batch": dict(
      zip(names, exp)), "speedup": d["speedup"], "grad_max_rel_err": d["grad_max_rel_err"],
          "encoder_forwards": d["encoder_forwards"],
          "encoder_share_naive": d["flops"]["encoder_share_naive"]}


# -- summary.md ----------------------------------------------------------------
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


def runs_section(r) -> list[str]:
  lines = ["## Staleness and learning in real tiny runs", "",
           f"`configs/text_grpo_tiny.gin`, {r['train_batches']} train batches per run "
           "(4 optimizer steps each), 2 rollout workers in the disaggregated runs; one run per "
           "row, one after another. W is the window of groups in flight (G = 16). traj/s is "
           "trajectories over the job's wall time from the start of its loop (compilation "
           "included, process start-up not).", "",
           "![runs staleness](runs_staleness.png)", "",
           "| run | steps | traj/s | mean max(a,0) | p50 | p99 | reduction vs train_batch W=2G | "
           "quota violations | reward first 10% | reward last 10% | wall s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name, p in r["policies"].items():
    red = p["reduction_vs_train_batch"]
    lines.append(f"| {name} | {p['steps']} | {p.get('traj_per_s', float('nan')):.1f} | "
                 f"{p['arch_mean']:.2f} | {p['arch_p50']:.0f} | "
                 f"{p['arch_p99']:.0f} | {'' if red is None else f'{red:.3f}'} | "
                 f"{p['quota_violations']} | {p['reward_first']:.3f} | {p['reward_last']:.3f} | "
                 f"{p['wall_s']:.0f} |")
  lines += ["", "![learning curves](learning_curves.png)", "",
            "One seed per run: the seed-to-seed spread of the reward was not measured, so "
            "read the learning curves as qualitative; the learning study below has 5 seeds "
            "per configuration and a held-out evaluation.", ""]
  est = {n: p["dispatch_estimates_s"] for n, p in r["policies"].items()
         if p.get("dispatch_estimates_s") and any(v is not None for v in p["dispatch_estimates_s"].values())}
  if est:
    lines += ["The `tails:` rows run `configs/text_grpo_tails.gin`'s mix (the long `chain_long` "
              "source, one group per worker sampler call); their reduction is against the "
              "`tails:` train-batch run. The quota-aware dispatch's learned generation time per "
              "group, by source (s):", ""]
    for name, e in est.items():
      lines.append(f"- {name}: " + ", ".join(f"{s} {v * 1e3:.1f} ms" for s, v in e.items()
                                            if v is not None))
    lines.append("")
  return lines


def transfer_section(t) -> list[str]:
  if any("prefetch_total_s" not in d for d in t.values()):  # numbers from before issue 29
    return ["## Transfer", "", "Numbers from before the prefetching baseline: remake them with "
            "`--only transfer`.", ""]
  lines = ["## Transfer: centralized baselines vs on-demand, end to end", "",
           "![transfer](transfer_latency.png)", "",
           "`python scripts/bench_transfer.py --workload text|vlm`. The headline is the total "
           "(transfer + training) against the strongest baseline, the centralized driver with "
           "one step of prefetch.", "",
           "| workload | trajectories | total s: centralized / + prefetch / on-demand | "
           "**total ratio** (vs + prefetch) | vs centralized | exposed s: centralized / + prefetch "
           "/ on-demand | MB moved: centralized (either) / on-demand |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for w, d in t.items():
    lines.append(
        f"| {w} | {d['trajectories']} | {d['baseline_total_s']:.2f} / {d['prefetch_total_s']:.2f}"
        f" / {d['ondemand_total_s']:.2f} | **{d['total_ratio']:.2f}x** | "
        f"{d['total_ratio_vs_centralized']:.2f}x | {d['baseline_exposed_s']:.3f} / "
        f"{d['prefetch_exposed_s']:.3f} / {d['ondemand_exposed_s']:.3f} | "
        f"{d['bytes_baseline'] / 1e6:.0f} / {d['bytes_ondemand'] / 1e6:.0f} |")
  lines += ["", "Seconds are summed over the whole bench (every mini-batch; the max over "
            "consumers), so a --quick run's are not comparable with a full run's. Exposed: the "
            "time a consumer's step waited for data. The vlm workload's bytes include the image "
            "copies the centralized driver sends per trajectory; `--no-dedup` compares at equal "
            "bytes (docs/dataplane.md).", ""]
  return lines


def multimodal_section(m) -> list[str]:
  c = m["config"]
  lines = ["## Multimodal: transfer + training per mini-batch, with the ablations", "",
           "![multimodal](multimodal_step.png)", "",
           f"{c['consumers']} consumers, {c['prompts']} prompts x n = {c['n']}, {c['image']} px "
           f"images, patch {c['patch']}, merge {c['merge']}, ViT / LM width {c['vit_width']} / "
           f"{c['lm_width']}; mean of {c['mini_batches']} mini-batches.", "",
           "| variant | s per mini-batch | of it exposed transfer (s) | speedup vs baseline |",
           "| --- | --- | --- | --- |"]
  per = m["seconds_per_mini_batch"]
  for name, sec in per.items():
    lines.append(f"| {name} | {sec:.2f} | {m['exposed_s_per_mini_batch'][name]:.2f} | "
                 f"{per['baseline'] / sec:.2f}x |")
  lines += ["", f"Gradient of the encode-once step against the naive one: max relative error "
            f"{m['grad_max_rel_err']:.1e}. Encoder forwards per mini-batch: "
            f"{m['encoder_forwards']['baseline']} -> {m['encoder_forwards']['knittrans']}. The "
            f"encoder is {100 * m['encoder_share_naive']:.0f}% of the naive step's forward FLOPs.",
            "", "How the speedup moves with n, image size and the encoder/backbone widths: "
            "![sweep](multimodal_sweep.png) (`python scripts/bench_multimodal.py --sweep --json "
            "figures/multimodal_sweep.json`, about 30 min here; not rerun by this script).", ""]
  return lines


def learning_section(lr) -> list[str]:
  return ["## Learning quality: does lower staleness narrow the gap to synchronous execution?",
          "", f"`python scripts/study.py --gin_file configs/study/staleness.gin` (base "
          f"`{lr['base_gin']}` with {', '.join(f'`{b}`' for b in lr['common_bindings'])}): "
          "every configuration with every seed, one run at a time; final reward = mean held-out "
          f"{lr['metric']} reward of the current policy over the last 10% of the steps. Gap "
          f"closed: share of the `{lr['reference']}` vs `{lr['baseline']}` gap in final reward, "
          f"paired by seed. Intervals: {lr.get('interval_method', 'n/a')}. Reported seeds "
          f"{lr.get('reported_seeds')}; settings chosen on seeds {lr.get('selection_seeds')}; "
          f"evaluation prompts that occur in training: {lr.get('eval_train_overlap')}. "
          "docs/learning.md reads it. The study resumes: its finished "
          "runs are read, not rerun, so the wall time in the table above is this call's; "
          "docs/learning.md gives the runs' own.", "",
          "![learning](study_learning_curves.png)", "", lr["table"], "",
          "![dose-response](study_dose_response.png)", ""]


SECTIONS = {"staleness": staleness_section, "runs": runs_section, "learning": learning_section,
            "transfer": transfer_section,
            "multimodal": multimodal_section}


def write_summary(out, numbers):
  made = numbers.get("made", {})
  lines = ["# Figures and the numbers behind them", "",
           "Made by `python scripts/reproduce_figures.py --out figures/` on a 2-core CPU machine "
           "(see the README); each section says what produced it.", "",
           "| group | made with | wall s |", "| --- | --- | --- |"]
  for group in SECTIONS:
    if group in made:
      lines.append(f"| {group} | `{made[group]['command']}` | {made[group]['wall_s']:.0f} |")
  lines.append("")
  for group, section in SECTIONS.items():
    if group in numbers:
      lines += section(numbers[group])
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("\n".join(lines))


GROUPS = ("staleness", "runs", "learning", "transfer", "multimodal")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  gin_cli.add_flags(parser)
  parser.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS),
                      help="figure groups to (re)make; the others keep their numbers")
  parser.add_argument("--out", default="figures")
  parser.add_argument("--quick", action="store_true",
                      help="every figure at reduced size, in a few minutes (prints each part's time)")
  parser.add_argument("--work", default="runs/figures",
                      help="where the runs and benchmark stores go (not committed)")
  parser.add_argument("--sensitivity_batches", type=int, default=None,
                      help="train batches per run in the sensitivity sweeps (default 10; quick 3)")
  parser.add_argument("--runs_matching", default=None,
                      help="runs group: rerun only the runs whose name starts with this "
                      "(e.g. 'tails:'), keeping the others' numbers")
  parser.add_argument("--train_batches", type=int, default=None,
                      help="train batches per tiny run (default 100; quick 8, five of the runs)")
  args = parser.parse_args()
  if not args.gin_file:
    args.gin_file = ["configs/sim/paper_text.gin"]
  args.workdir = args.workdir or args.out
  gin_cli.parse(args)
  os.makedirs(args.out, exist_ok=True)
  os.makedirs(args.work, exist_ok=True)
  numbers_path = os.path.join(args.out, "numbers.json")
  numbers = {}
  if os.path.exists(numbers_path):  # groups not remade keep their numbers
    with open(numbers_path) as f:
      numbers = json.load(f)
    if "staleness" in numbers and "made" not in numbers:
      numbers["made"] = {"staleness": {"command": "--only staleness", "wall_s": numbers.get("wall_s", 0)}}
  numbers.setdefault("made", {})
  numbers.pop("wall_s", None)
  command = " ".join(["python scripts/reproduce_figures.py"] + (["--quick"] if args.quick else [])
                     + ([f"--runs_matching '{args.runs_matching}'"] if args.runs_matching else [])
                     + ([f"--train_batches {args.train_batches}"] if args.train_batches else [])
                     + ([f"--sensitivity_batches {args.sensitivity_batches}"]
                        if args.sensitivity_batches else []))
  sens = args.sensitivity_batches or (3 if args.quick else 10)
  batches = args.train_batches or (8 if args.quick else 100)
  makers = {
      "staleness": lambda: staleness(args.out, sens, (0,) if args.quick else (0, 1, 2, 3, 4)),
      "runs": lambda: real_runs(args.out, os.path.abspath(args.work), batches,
                                args.runs_matching, numbers.get("runs"), args.quick),
      "learning": lambda: learning(args.out, os.path.abspath(args.work), args.quick),
      "transfer": lambda: transfer(args.out, os.path.abspath(args.work), args.quick),
      "multimodal": lambda: multimodal(args.out, os.path.abspath(args.work), args.quick),
  }
  t_all = time.perf_counter()
  for group in GROUPS:
    if group not in args.only:
      continue
    t0 = time.perf_counter()
    numbers[group] = makers[group]()
    numbers["made"][group] = {"command": command, "wall_s": time.perf_counter() - t0}
    print(f"{group}: {numbers['made'][group]['wall_s']:.0f} s", flush=True)
    with open(numbers_path, "w") as f:  # after every group: an interrupted run keeps the rest
      json.dump(numbers, f, indent=1, default=float)
    write_summary(args.out, numbers)
  gin_cli.save_operative_config(args.out)
  print(open(os.path.join(args.out, "summary.md")).read())
  print("time per part: " + ", ".join(f"{g} {numbers['made'][g]['wall_s']:.0f} s"
                                      for g in GROUPS if g in args.only))
  print(f"all groups in {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
  main()
