"""The real tiny runs' figures: scripts/train.py on configs/text_grpo_tiny.gin, once
per admission policy and colocated, their measured staleness and learning curves
(scripts/reproduce_figures.py --only runs)."""
from __future__ import annotations

import json
import os
import sys

import gin
import matplotlib
from gin import config_parser

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from figures_common import ROOT, run_logged  # noqa: E402
from knittrans_jax.job.metrics import read_metrics  # noqa: E402

TINY_GIN = "configs/text_grpo_tiny.gin"
# name: (the window W as a multiple of G, groups per train batch in TINY_GIN, or None
# for the job's default; gin bindings on TINY_GIN). The window (groups dispatched, not
# yet trained) sets the pipeline depth: at one W every policy has about the same
# staleness (Little's law); what early admission buys is reaching the baseline's
# throughput with a smaller W, as in the simulator.
RUNS = {
    "colocated": (None, ["JobConfig.mode = 'colocated'"]),
    "train_batch W=2G": (2, ["JobConfig.policy = 'train_batch'"]),
    "constraint_preserving W=2G": (2, ["JobConfig.policy = 'constraint_preserving'"]),
    "constraint_preserving W=G": (1, ["JobConfig.policy = 'constraint_preserving'"]),
    "constraint_preserving W=G/2": (1 / 2, ["JobConfig.policy = 'constraint_preserving'"]),
    "fifo W=G/2": (1 / 2, ["JobConfig.policy = 'fifo'"]),
    "constraint_preserving+quota_aware W=G/2": (1 / 2, [
        "JobConfig.policy = 'constraint_preserving'", "JobConfig.dispatch = 'quota_aware'"]),
}
# configs/text_grpo_tails.gin's long source and one group per worker call, where
# the sources' completion times differ (issue 16): the dispatch policies side by side.
TAILS = ["TrainBatchSpec.source_quota = {'nearest': 6, 'count': 5, 'chain_long': 5}",
         "JobConfig.groups_per_call = 1"]
RUNS.update({
    "tails: train_batch W=2G": (2, [*TAILS, "JobConfig.policy = 'train_batch'"]),
    "tails: constraint_preserving W=G/2": (1 / 2, [
        *TAILS, "JobConfig.policy = 'constraint_preserving'"]),
    "tails: constraint_preserving+quota_aware W=G/2": (1 / 2, [
        *TAILS, "JobConfig.policy = 'constraint_preserving'", "JobConfig.dispatch = 'quota_aware'"]),
})


def gin_binding(path: str, name: str):
  """The value the gin file `path` (or a file it includes; paths from the repository
  root) binds `name` ('Configurable.parameter') to, the last binding winning as in
  gin; None if none does. Read with gin's parser, not into gin's config, which holds
  the simulator's (with another G)."""
  value = None
  with open(os.path.join(ROOT, path)) as f:
    for st in config_parser.ConfigParser(f, gin.config.ParserDelegate(skip_unknown=True)):
      if isinstance(st, config_parser.IncludeStatement):
        included = gin_binding(st.filename, name)
        value = value if included is None else included
      elif (isinstance(st, config_parser.BindingStatement) and not st.scope
            and f"{st.selector}.{st.arg_name}" == name):
        value = st.value
  return value


def tiny_groups_per_batch() -> int:
  G = gin_binding(TINY_GIN, "TrainBatchSpec.groups_per_batch")
  if not isinstance(G, int) or G <= 0:
    raise ValueError(f"{TINY_GIN}: TrainBatchSpec.groups_per_batch = {G!r}, not a positive int")
  return G


def run_bindings(name: str, G: int) -> list[str]:
  """RUNS[name]'s gin bindings, its window W = multiple x G written out."""
  multiple, bindings = RUNS[name]
  if multiple is None:
    return list(bindings)
  window = multiple * G
  if window != int(window) or window < 1:
    raise ValueError(f"run {name!r}: W = {multiple} G = {window} with G = {G} is not a whole "
                     "number of groups")
  return [*bindings, f"JobConfig.window = {int(window)}"]


BASELINE_RUN = "train_batch W=2G"
RUN_STYLE = {"colocated": ("k", "-"), "train_batch W=2G": ("tab:red", "-"),
             "constraint_preserving W=2G": ("tab:blue", ":"),
             "constraint_preserving W=G": ("tab:blue", "--"),
             "constraint_preserving W=G/2": ("tab:blue", "-"), "fifo W=G/2": ("tab:gray", "-"),
             "constraint_preserving+quota_aware W=G/2": ("tab:cyan", "-"),
             "tails: train_batch W=2G": ("tab:red", ":"),
             "tails: constraint_preserving W=G/2": ("tab:blue", ":"),
             "tails: constraint_preserving+quota_aware W=G/2": ("tab:cyan", ":")}


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
  G = tiny_groups_per_batch()
  bar = tqdm(todo, desc="tiny runs", unit="run")
  for name in bar:
    bar.set_postfix(run=name)
    wd = os.path.join(work, "runs", name.replace(" ", "_").replace("/", "_"))
    os.makedirs(os.path.dirname(wd), exist_ok=True)
    cmd = [sys.executable, "scripts/train.py", "--gin_file", TINY_GIN,
           "--workdir", wd, "--overwrite",
           "--gin_bindings", f"JobConfig.train_batches = {train_batches}",
           # Staleness and throughput are what these runs show; the learning study evaluates.
           "--gin_bindings", "EvalConfig.every_steps = 0"]
    for b in run_bindings(name, G):
      cmd += ["--gin_bindings", b]
    run_logged(cmd, wd + ".log", f"the {name} run")
    results[name] = run_result(wd)
  results = {k: results[k] for k in RUNS if k in results}  # the table's order
  return {"train_batches": train_batches, "groups_per_batch": G,
          "policies": runs_figures(results, out)}


def run_result(workdir: str) -> dict:
  """What the figures take from a finished job's metrics.jsonl and summary.json."""
  records = read_metrics(workdir)
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
  ax.set_title(f"Measured in tiny text runs ({TINY_GIN})")
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


def runs_section(r) -> list[str]:
  # Numbers from before groups_per_batch was recorded ran TINY_GIN's G as it is now.
  G = r.get("groups_per_batch") or tiny_groups_per_batch()
  M = gin_binding(TINY_GIN, "TrainBatchSpec.num_mini_batches")
  workers = gin_binding(TINY_GIN, "JobConfig.workers")
  lines = ["## Staleness and learning in real tiny runs", "",
           f"`{TINY_GIN}`, {r['train_batches']} train batches per run "
           f"({M} optimizer steps each), {workers} rollout workers in the disaggregated runs; "
           f"one run per row, one after another. W is the window of groups in flight (G = {G}). traj/s is "
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
            "read the learning curves as qualitative; the learning studies below have 10 seeds "
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
