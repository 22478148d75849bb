"""Runs a grid of job configurations x seeds, one after another, and writes one
results table with means and bootstrap intervals over seeds.

  python scripts/study.py --gin_file configs/study/staleness.gin --out runs/study

Each run is `scripts/train.py` on `study.base_gin` plus the configuration's gin
bindings and `JobConfig.seed`. Resumable: a run whose summary.json exists and whose
gin file and bindings are the ones recorded beside it (WORKDIR.run.json) is not
rerun; an interrupted one is continued from its checkpoint (`--resume`), or started
over if it has none or was started with other settings. Runs go one at a time by
default: each job already runs a trainer and its rollout workers on this machine's
two cores, so two at once would time-share them and change the throughput being
measured (`study.parallel`).

Every run is scored by the held-out evaluation of its current policy
(job/evaluation.py; the base config must set EvalConfig.every_steps) on prompts
training never draws (data/split.py; each run's `eval_train_overlap` says 0): final
reward = mean `study.metric` evaluation reward over the last 10% of the steps; steps
and training seconds to `study.threshold`.

Statistics (study/stats.py), written into the JSON as `interval_method`:
- per configuration, the mean over seeds with a Student-t 95% interval;
- with `study.baseline` and `study.reference`, the share of their gap each other
  configuration closes, paired by seed (same initial weights and prompt stream) with
  a BCa bootstrap interval over seeds;
- `study.comparisons` {name: other}: the paired difference in final reward, e.g.
  constraint-preserving against train-batch at the same window (what the window
  alone buys is then visible);
- `study.dose_configurations`: final reward against mean staleness, per
  configuration (mean and t interval) and a saturating fit over every run.
Settings are chosen on `study.selection_seeds`, which must not be among the
reported `study.seeds` (a setting chosen on the seeds it is reported on is biased
towards them).

Writes OUT/results.json (every run's fields and curve, the summary above),
OUT/results.md, OUT/learning_curves.png and, with `study.dose_configurations`,
OUT/dose_response.png.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

import gin
import numpy as np
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from knittrans_jax import cli, gin_cli  # noqa: E402
from knittrans_jax.study import plots  # noqa: E402
from knittrans_jax.job.metrics import read_metrics  # noqa: E402
from knittrans_jax.study.curves import eval_curve, final_reward, first_reaching  # noqa: E402
from knittrans_jax.study.stats import (paired_difference, paired_gap_closed,  # noqa: E402
                                       saturating_fit, t_interval)

FIELDS = ("reward_last", "arch_staleness_mean", "quota_violations", "wall_s", "eval_s", "steps",
          "trajectories", "eval_train_overlap", "policy", "policy_options")
INTERVAL_METHOD = ("mean over seeds: Student-t 95%; gap closed: paired by seed, BCa bootstrap "
                   "95% (10,000 resamples); comparisons: paired difference by seed, Student-t 95%")
PER_CONFIG = ("final_reward", "steps_to_threshold", "train_s_to_threshold", "arch_staleness_mean",
              "traj_per_s", "reward_last", "quota_error", "trained_share",
              "slowest_decile_trained")


def run_dir(out: str, name: str, seed: int) -> str:
  return os.path.join(out, "runs", name.replace(" ", "_").replace("/", "_"), f"seed{seed}")


RUN_RECORD = ".run.json"  # WORKDIR.run.json: the gin file and bindings WORKDIR was started with


def _recorded_run(wd: str) -> dict | None:
  try:
    with open(wd + RUN_RECORD) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def plan_run(wd: str, run: dict) -> str:
  """'reuse' a finished run, 'resume' an interrupted one from its checkpoint, or
  'overwrite'. Only a run started with this very gin file and bindings is reused or
  resumed: a study file edited since, or another study in the same --out, reruns it."""
  if _recorded_run(wd) != run:
    return "overwrite"
  if os.path.exists(os.path.join(wd, "summary.json")):
    return "reuse"
  ckpt = os.path.join(wd, "checkpoints")
  return "resume" if os.path.isdir(ckpt) and os.listdir(ckpt) else "overwrite"


def run_one(out: str, base_gin: str, name: str, bindings: list[str], seed: int,
            common: list[str], metric: str, threshold: float | None) -> dict:
  wd = run_dir(out, name, seed)
  summary = os.path.join(wd, "summary.json")
  run = {"base_gin": base_gin, "bindings": [*common, *bindings, f"JobConfig.seed = {seed}"]}
  how = plan_run(wd, run)
  if how != "reuse":
    cmd = [sys.executable, "scripts/train.py", "--gin_file", base_gin, "--workdir", wd,
           f"--{how}"]
    for b in run["bindings"]:
      cmd += ["--gin_bindings", b]
    os.makedirs(os.path.dirname(wd), exist_ok=True)
    with open(wd + RUN_RECORD, "w") as f:  # beside it: --overwrite empties wd
      json.dump(run, f, indent=1)
    with open(wd + ".log", "w") as log:
      code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_PLATFORMS": os.environ.get(
                                "JAX_PLATFORMS", "cpu")}).returncode
    if code:
      with open(wd + ".log") as f:
        tail = "".join(f.readlines()[-15:])
      raise RuntimeError(f"run {name!r} seed {seed} failed (exit {code}); {wd}.log ends:\n{tail}")
  with open(summary) as f:
    s = json.load(f)
  row = {"configuration": name, "seed": seed, "workdir": wd, **{k: s.get(k) for k in FIELDS}}
  # Throughput over training time: the held-out evaluation is not part of the system.
  row["traj_per_s"] = s["trajectories"] / (s["wall_s"] - s.get("eval_s", 0.0))
  # What the admission rule gave up (admission/costs.py): beside the reward it bought.
  q, t = s.get("quota_error"), s.get("tail_bias") or {}
  row["quota_error"] = None if q is None else q["mean"]
  row["trained_share"] = t.get("trained_share")
  row["slowest_decile_trained"] = (t["by_decile"][-1]["trained_share"]
                                   if t.get("by_decile") else None)
  curve = eval_curve(read_metrics(wd), metric)
  row["curve"] = curve
  row["final_reward"] = final_reward(curve, s["steps"])
  hit = first_reaching(curve, threshold) if threshold is not None else None
  row["steps_to_threshold"], row["train_s_to_threshold"] = hit if hit else (None, None)
  return row


def _by_seed(rows: list[dict], name: str, key: str = "final_reward") -> dict[int, float]:
  return {r["seed"]: r[key] for r in rows if r["configuration"] == name and r[key] is not None}


def _paired(rows, *names) -> list[list[float]]:
  """Final rewards of `names` over the seeds all of them ran, in seed order."""
  series = [_by_seed(rows, n) for n in names]
  seeds = sorted(set.intersection(*(set(s) for s in series)))
  return [[s[k] for k in seeds] for s in series]


def aggregate(rows: list[dict], names: list[str], baseline: str | None,
              reference: str | None, comparisons: dict | None = None) -> dict:
  out = {}
  for name in names:
    mine = [r for r in rows if r["configuration"] == name]
    entry = {"seeds": sorted(r["seed"] for r in mine)}
    for key in PER_CONFIG:
      values = [r[key] for r in mine if r[key] is not None]
      if values:
        entry[f"{key}_mean"] = sum(values) / len(values)
        entry[f"{key}_ci95"] = list(t_interval(values))
    entry["reached_threshold"] = sum(r["steps_to_threshold"] is not None for r in mine)
    entry["quota_violations"] = sum(r["quota_violations"] or 0 for r in mine)
    out[name] = entry
  if baseline and reference:
    for name in names:
      if name not in (baseline, reference):
        p, b, r = _paired(rows, name, baseline, reference)
        if len(p) >= 2:
          share, ci = paired_gap_closed(p, b, r)
          out[name]["gap_closed"], out[name]["gap_closed_ci95"] = share, list(ci)
  for name, other in (comparisons or {}).items():
    a, b = _paired(rows, name, other)
    if len(a) >= 2:
      diff, ci = paired_difference(a, b)
      out[name].setdefault("vs", {})[other] = {"difference": diff, "ci95": list(ci),
                                               "seeds": len(a)}
  return out


def dose_response(rows: list[dict], names) -> dict | None:
  """Final reward against mean architectural staleness: per configuration (means and
  t intervals) and a saturating fit over every run (study/stats.saturating_fit); a
  line through a curve that levels off would misstate both ends."""
  pts = [(r["arch_staleness_mean"], r["final_reward"]) for r in rows if r["configuration"] in names]
  if len(pts) < 3 or len({x for x, _ in pts}) < 2:
    print(f"dose-response: {len(pts)} runs over {len({x for x, _ in pts})} distinct staleness "
          "values; nothing to fit")
    return None
  per = []
  for name in names:
    mine = [r for r in rows if r["configuration"] == name]
    if mine:
      ys = [r["final_reward"] for r in mine]
      per.append({"configuration": name, "runs": len(mine),
                  "staleness_mean": float(np.mean([r["arch_staleness_mean"] for r in mine])),
                  "final_reward_mean": float(np.mean(ys)), "final_reward_ci95": list(t_interval(ys))})
  return {"configurations": list(names), "points": pts, "per_configuration": per,
          "fit": saturating_fit([x for x, _ in pts], [y for _, y in pts])}


@gin.configurable
def study(out: str, base_gin: str = "configs/text_grpo_tiny.gin",
          configurations: dict = gin.REQUIRED, seeds=(0, 1, 2, 3, 4), common_bindings=(),
          parallel: int = 1, metric: str = "sampled", threshold: float | None = None,
          baseline: str | None = None, reference: str | None = None,
          dose_configurations=(), train_batches: int | None = None, comparisons=None,
          selection_seeds=(), check: bool = False) -> dict | None:
  """configurations: {name: [gin bindings]}; every one runs with every seed.
  baseline / reference: the configurations whose gap the others close (e.g.
  'train_batch W=2G' and 'synchronous'). dose_configurations: the runs of the
  dose-response fit (one policy across windows). train_batches: overrides the base
  config's JobConfig.train_batches in every run (shorter studies). comparisons:
  {name: other configuration}, the paired differences to report. selection_seeds:
  the seeds the settings were chosen on (recorded; none may be reported). check: return
  None once the study's settings are checked, running nothing (--check_args)."""
  if not configurations:
    raise ValueError("study.configurations is empty: give {name: [gin bindings]}")
  if parallel < 1:
    raise ValueError(f"study.parallel = {parallel} must be >= 1")
  names = list(configurations)
  reused = sorted(set(seeds) & set(selection_seeds))
  if reused:
    raise ValueError(f"study.seeds and study.selection_seeds share {reused}: the settings were "
                     "chosen on those seeds, so reporting them is biased; report new seeds")
  comparisons = dict(comparisons or {})
  for what, name in (("baseline", baseline), ("reference", reference),
                     *(("dose_configurations", n) for n in dose_configurations),
                     *(("comparisons", n) for pair in comparisons.items() for n in pair)):
    if name is not None and name not in configurations:
      raise ValueError(f"study.{what} = {name!r} is not one of study.configurations {names}")
  common = list(common_bindings)
  if train_batches is not None:
    common.append(f"JobConfig.train_batches = {train_batches}")
  if check:
    return None
  grid = [(name, seed) for name in names for seed in seeds]
  t0 = time.perf_counter()
  rows = []
  with tqdm(total=len(grid), desc="study", unit="run") as bar, \
      concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    futures = {pool.submit(run_one, out, base_gin, name, list(configurations[name]), seed,
                           common, metric, threshold): (name, seed)
               for name, seed in grid}
    for fut in concurrent.futures.as_completed(futures):
      rows.append(fut.result())
      bar.set_postfix(last=f"{futures[fut][0]}/seed{futures[fut][1]}")
      bar.update()
  rows.sort(key=lambda r: (names.index(r["configuration"]), r["seed"]))
  result = {"base_gin": base_gin, "seeds": list(seeds), "common_bindings": common,
            "configurations": {n: list(configurations[n]) for n in names}, "metric": metric,
            "threshold": threshold, "baseline": baseline, "reference": reference,
            "interval_method": INTERVAL_METHOD, "selection_seeds": list(selection_seeds),
            "reported_seeds": sorted(set(seeds)),
            "eval_train_overlap": max((r["eval_train_overlap"] for r in rows
                                       if r["eval_train_overlap"] is not None), default=None),
            "comparisons": comparisons,
            "runs": rows, "summary": aggregate(rows, names, baseline, reference, comparisons),
            "dose_response": dose_response(rows, dose_configurations),
            "wall_s": time.perf_counter() - t0}
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(table(result))
  plots.learning_curves(result, os.path.join(out, "learning_curves.png"))
  if result["dose_response"]:
    plots.dose_response(result, os.path.join(out, "dose_response.png"))
  print(table(result))
  return result


def _ci(s: dict, key: str, fmt: str) -> str:
  if f"{key}_mean" not in s:
    return "n/a"
  lo, hi = s[f"{key}_ci95"]
  return f"{s[f'{key}_mean']:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def table(result: dict) -> str:
  thr = result.get("threshold")
  lines = [f"| configuration | seeds | final {result.get('metric', 'sampled')} eval reward "
           f"(mean, 95% CI) | steps to {thr} | train s to {thr} | gap closed | mean max(a,0) | "
           "traj/s | quota violations | quota error (L1) | trained share (slowest decile) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for name, s in result["summary"].items():
    n = len(s["seeds"])
    reached = f" ({s['reached_threshold']}/{n})" if thr is not None else ""
    gap = "n/a"
    if "gap_closed" in s:
      lo, hi = s["gap_closed_ci95"]
      gap = f"{s['gap_closed']:.2f} [{lo:.2f}, {hi:.2f}]"
    lines.append(f"| {name} | {n} | {_ci(s, 'final_reward', '.3f')} | "
                 f"{_ci(s, 'steps_to_threshold', '.0f')}{reached} | "
                 f"{_ci(s, 'train_s_to_threshold', '.0f')} | {gap} | "
                 f"{s.get('arch_staleness_mean_mean', float('nan')):.2f} | "
                 f"{s.get('traj_per_s_mean', float('nan')):.1f} | {s['quota_violations']} | "
                 f"{s.get('quota_error_mean', float('nan')):.3f} | "
                 f"{s.get('trained_share_mean', float('nan')):.2f} "
                 f"({s.get('slowest_decile_trained_mean', float('nan')):.2f}) |")
  pairs = [(name, other, v) for name, s in result["summary"].items()
           for other, v in s.get("vs", {}).items()]
  if pairs:
    lines += ["", "| configuration | against | final reward difference (paired, 95% CI) | seeds |",
              "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {other} | {v['difference']:+.3f} [{v['ci95'][0]:+.3f}, "
              f"{v['ci95'][1]:+.3f}] | {v['seeds']} |" for name, other, v in pairs]
  d = result.get("dose_response")
  if d:
    lines.append(f"\nDose-response over {', '.join(d['configurations'])} ({len(d['points'])} runs): "
                 + ", ".join(f"{p['configuration']} a = {p['staleness_mean']:.2f}: "
                             f"{p['final_reward_mean']:.3f} [{p['final_reward_ci95'][0]:.3f}, "
                             f"{p['final_reward_ci95'][1]:.3f}]" for p in d["per_configuration"]))
    f = d.get("fit")
    if f:
      lines.append(f"Saturating fit: reward = {f['floor']:.3f} + ({f['top']:.3f} - {f['floor']:.3f})"
                   f" exp(-a / {f['scale']:.2f}) (rmse {f['rmse']:.3f}).")
  lines.append(f"\nIntervals: {result.get('interval_method', 'n/a')}. Reported seeds "
               f"{result.get('reported_seeds')}; settings chosen on seeds "
               f"{result.get('selection_seeds') or 'n/a'}; evaluation prompts seen in training: "
               f"{result.get('eval_train_overlap')}.")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_flags(parser)
  parser.add_argument("--out", default="runs/study", help="output directory")
  args = parser.parse_args()
  if not args.gin_file:
    args.gin_file = ["configs/study/staleness.gin"]
  args.workdir = args.workdir or args.out
  cli.parse(args)
  study(args.out, check=args.check_args)
  if cli.check_only(args):
    return
  gin_cli.save_operative_config(args.out)


if __name__ == "__main__":
  main()
