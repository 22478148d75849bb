"""Runs a grid of job configurations x seeds, one after another, and writes one
results table with means and bootstrap intervals over seeds.

  python scripts/study.py --gin_file configs/study/staleness.gin --out runs/study

Each run is `scripts/train.py` on `study.base_gin` plus the configuration's gin
bindings and `JobConfig.seed`. Resumable: a run whose summary.json exists is not
rerun; an interrupted one is continued from its checkpoint (`--resume`), or started
over if it has none. Runs go one at a time by default: each job already runs a
trainer and its rollout workers on this machine's two cores, so two at once would
time-share them and change the throughput being measured (`study.parallel`).

Writes OUT/results.json (every run's summary fields and, per configuration, the mean
and 95% bootstrap interval over seeds) and OUT/results.md.
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
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from knittrans_jax import gin_cli  # noqa: E402
from knittrans_jax.study.stats import bootstrap_ci  # noqa: E402

FIELDS = ("reward_first", "reward_last", "arch_staleness_mean", "quota_violations", "wall_s",
          "steps", "trajectories")


def run_dir(out: str, name: str, seed: int) -> str:
  return os.path.join(out, "runs", name.replace(" ", "_").replace("/", "_"), f"seed{seed}")


def run_one(out: str, base_gin: str, name: str, bindings: list[str], seed: int,
            common: list[str]) -> dict:
  wd = run_dir(out, name, seed)
  summary = os.path.join(wd, "summary.json")
  if not os.path.exists(summary):
    resume = os.path.isdir(os.path.join(wd, "checkpoints")) and os.listdir(
        os.path.join(wd, "checkpoints"))
    cmd = [sys.executable, "scripts/train.py", "--gin_file", base_gin, "--workdir", wd,
           "--resume" if resume else "--overwrite"]
    for b in [*common, *bindings, f"JobConfig.seed = {seed}"]:
      cmd += ["--gin_bindings", b]
    os.makedirs(os.path.dirname(wd), exist_ok=True)
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
  row = {"configuration": name, "seed": seed, "workdir": wd,
         **{k: s.get(k) for k in FIELDS}}
  row["traj_per_s"] = s["trajectories"] / s["wall_s"] if s.get("wall_s") else None
  return row


def aggregate(rows: list[dict], names: list[str]) -> dict:
  out = {}
  for name in names:
    mine = [r for r in rows if r["configuration"] == name]
    entry = {"seeds": sorted(r["seed"] for r in mine)}
    for key in ("reward_last", "arch_staleness_mean", "traj_per_s"):
      values = [r[key] for r in mine if r[key] is not None]
      if values:
        entry[f"{key}_mean"] = sum(values) / len(values)
        entry[f"{key}_ci95"] = list(bootstrap_ci(values))
    entry["quota_violations"] = sum(r["quota_violations"] or 0 for r in mine)
    out[name] = entry
  return out


@gin.configurable
def study(out: str, base_gin: str = "configs/text_grpo_tiny.gin",
          configurations: dict = gin.REQUIRED, seeds=(0, 1, 2, 3, 4), common_bindings=(),
          parallel: int = 1) -> dict:
  """configurations: {name: [gin bindings]}; every one runs with every seed."""
  if not configurations:
    raise ValueError("study.configurations is empty: give {name: [gin bindings]}")
  if parallel < 1:
    raise ValueError(f"study.parallel = {parallel} must be >= 1")
  names = list(configurations)
  grid = [(name, seed) for name in names for seed in seeds]
  t0 = time.perf_counter()
  rows = []
  with tqdm(total=len(grid), desc="study", unit="run") as bar, \
      concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    futures = {pool.submit(run_one, out, base_gin, name, list(configurations[name]), seed,
                           list(common_bindings)): (name, seed) for name, seed in grid}
    for fut in concurrent.futures.as_completed(futures):
      rows.append(fut.result())
      bar.set_postfix(last=f"{futures[fut][0]}/seed{futures[fut][1]}")
      bar.update()
  rows.sort(key=lambda r: (names.index(r["configuration"]), r["seed"]))
  result = {"base_gin": base_gin, "seeds": list(seeds), "common_bindings": list(common_bindings),
            "configurations": {n: list(configurations[n]) for n in names},
            "runs": rows, "summary": aggregate(rows, names),
            "wall_s": time.perf_counter() - t0}
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(table(result))
  print(table(result))
  return result


def table(result: dict) -> str:
  lines = ["| configuration | seeds | final reward (mean, 95% CI) | mean max(a,0) | traj/s | "
           "quota violations |", "| --- | --- | --- | --- | --- | --- |"]
  for name, s in result["summary"].items():
    ci = s.get("reward_last_ci95", [float("nan")] * 2)
    lines.append(f"| {name} | {len(s['seeds'])} | {s.get('reward_last_mean', float('nan')):.3f} "
                 f"[{ci[0]:.3f}, {ci[1]:.3f}] | {s.get('arch_staleness_mean_mean', float('nan')):.2f} | "
                 f"{s.get('traj_per_s_mean', float('nan')):.1f} | {s['quota_violations']} |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  gin_cli.add_flags(parser)
  parser.add_argument("--out", default="runs/study", help="output directory")
  args = parser.parse_args()
  if not args.gin_file:
    args.gin_file = ["configs/study/staleness.gin"]
  args.workdir = args.workdir or args.out
  gin_cli.parse(args)
  study(args.out)
  gin_cli.save_operative_config(args.out)


if __name__ == "__main__":
  main()
