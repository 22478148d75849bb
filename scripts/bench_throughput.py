"""Steady-state throughput of job configurations, run one at a time, interleaved.

  python scripts/bench_throughput.py --gin_file configs/text_grpo_rollout_bound.gin \
      --config "tb W=2G: JobConfig.policy = 'train_batch'; JobConfig.window = 32" \
      --config "cp W=G: JobConfig.policy = 'constraint_preserving'; JobConfig.window = 16" \
      --repeats 3 --train_batches 50 --json runs/throughput.json

Each configuration (a name, then `;`-separated gin bindings) runs `scripts/train.py`
--repeats times, the repeats interleaved (A B A B ...) so that a drift of the
machine hits every configuration alike, with held-out evaluation off. Throughput is
trajectories per second in steady state: over the steps after the first
--skip_train_batches train batches, from each step's `time_s` in metrics.jsonl, so
start-up and compilation are left out. Writes per configuration every run's figure,
their mean, min and max, and each run's mean architectural staleness and engine-vs-
trainer log-prob difference (|difference| mean and max over tokens at version lag 0,
as the job's summary reports them; e.g. `VllmOptions.in_flight` 'reprefill' against
'keep', docs/rollout.md). Run it with nothing else on the machine: every process of
a run shares its cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import gin
import numpy as np
from tqdm import tqdm

from knittrans_jax import cli
from knittrans_jax.job.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steady_traj_per_s(workdir: str, skip_steps: int) -> float:
  recs = read_metrics(workdir)
  if len(recs) <= skip_steps + 1:
    raise ValueError(f"{workdir}: {len(recs)} steps, not more than the {skip_steps} skipped + 1")
  start, rest = recs[skip_steps - 1] if skip_steps else None, recs[skip_steps:]
  t0 = start["time_s"] if start else 0.0
  return sum(r["trajectories"] for r in rest) / (rest[-1]["time_s"] - t0)


def parse_config(text: str) -> tuple[str, list[str]]:
  name, sep, bindings = text.partition(":")
  if not sep or not name.strip():
    raise ValueError(f"--config {text!r}: give 'NAME: binding; binding; ...'")
  return name.strip(), [b.strip() for b in bindings.split(";") if b.strip()]


def run_bindings(train_batches: int) -> list[str]:
  """What every benchmarked run binds before its configuration's bindings."""
  return [f"JobConfig.train_batches = {train_batches}", "EvalConfig.every_steps = 0"]


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", required=True)
  parser.add_argument("--config", action="append", required=True,
                      help="'NAME: binding; binding; ...' (repeat the flag per configuration)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--train_batches", type=int, default=50)
  parser.add_argument("--skip_train_batches", type=int, default=5,
                      help="train batches left out of the steady state (start-up)")
  parser.add_argument("--json", required=True)
  cli.add_check_flag(parser)
  args = parser.parse_args()
  try:
    configs = dict(parse_config(c) for c in args.config)
  except ValueError as e:
    parser.error(str(e))
  if len(configs) != len(args.config):
    parser.error("--config names must be distinct")
  if args.check_args:  # each configuration's job, as its train.py run would build it
    for bindings in configs.values():
      cli.parse(argparse.Namespace(gin_file=[args.gin_file], gin_bindings=[
          *run_bindings(args.train_batches), *bindings], check_args=True))
      cli.check_job()
      gin.clear_config()
    cli.check_only(args)
    return
  tmp = tempfile.mkdtemp(prefix="bench_throughput_")
  runs = {name: [] for name in configs}
  skip = None
  try:  # every run's workdir (store, checkpoints) goes when the benchmark ends
    with tqdm(total=args.repeats * len(configs), desc="runs", unit="run") as bar:
      for rep in range(args.repeats):
        for name, bindings in configs.items():
          wd = os.path.join(tmp, f"config{list(configs).index(name)}_run{len(runs[name])}")
          cmd = [sys.executable, "scripts/train.py", "--gin_file", args.gin_file, "--workdir", wd,
                 "--overwrite"]
          for b in [*run_bindings(args.train_batches), *bindings]:
            cmd += ["--gin_bindings", b]
          proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
          if proc.returncode:
            raise RuntimeError(f"{name} (repeat {rep}) failed:\n{proc.stderr[-3000:]}")
          with open(os.path.join(wd, "summary.json")) as f:
            summary = json.load(f)
          per_batch = summary["steps"] // args.train_batches
          skip = args.skip_train_batches * per_batch
          runs[name].append({"traj_per_s": steady_traj_per_s(wd, skip),
                             "arch_staleness_mean": summary["arch_staleness_mean"],
                             "logprob_abs_diff_mean": summary["logprob_abs_diff_mean"],
                             "logprob_abs_diff_max": summary["logprob_abs_diff_max"],
                             "wall_s": summary["wall_s"]})
          bar.update()
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  out = {"gin_file": args.gin_file, "train_batches": args.train_batches, "skipped_steps": skip,
         "repeats": args.repeats, "cpu_count": os.cpu_count(), "configurations": {}}
  for name, rs in runs.items():
    x = [r["traj_per_s"] for r in rs]
    out["configurations"][name] = {"bindings": configs[name], "runs": rs,
                                   "traj_per_s_mean": float(np.mean(x)),
                                   "traj_per_s_min": min(x), "traj_per_s_max": max(x)}
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"\nsteady-state throughput, {args.gin_file}, {args.repeats} interleaved runs each "
        f"({args.train_batches} train batches, the first {args.skip_train_batches} left out):")
  for name, c in out["configurations"].items():
    runs_ = ", ".join(f"{r['traj_per_s']:.0f}" for r in c["runs"])
    stale = ", ".join(f"{r['arch_staleness_mean']:.2f}" for r in c["runs"])
    gap = ", ".join("-" if r["logprob_abs_diff_mean"] is None else
                    f"{r['logprob_abs_diff_mean']:.2g}/{r['logprob_abs_diff_max']:.2g}"
                    for r in c["runs"])
    print(f"  {name:<40} mean {c['traj_per_s_mean']:7.1f} traj/s  (runs {runs_}; "
          f"mean max(a,0) {stale}; log-prob |diff| mean/max {gap})")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
