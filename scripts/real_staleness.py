"""The headline in the real job: architectural staleness at matched throughput, and
the simulator checked against every run (issue 45, parts 1 and 2).

  python scripts/real_staleness.py --gin_file configs/agentic_tails.gin --seeds 0,1,2 \
      --train_batches 20 --skip_train_batches 3 --json runs/real_staleness_agentic.json

Runs `scripts/train.py` (held-out evaluation off), one run at a time, each seed of a
configuration before the next configuration:
  1. train-batch admission at W = G, 2G and 4G (the baselines, shuffled dispatch);
  2. constraint-preserving admission with each --dispatch, at windows --windows x g
     in increasing order, until its mean throughput over the seeds reaches the
     fastest baseline's (or the windows run out);
  3. train-batch at each matched window not run yet (what the window alone buys).
Throughput is steady state: trajectories per second over the steps after the first
--skip_train_batches train batches (start-up and compiling left out), as
scripts/bench_throughput.py measures it. The matching, its spread and the paired
reductions are study/matched.py's.

Each run's trace.json (its groups' generation times and its steps' times) is then
replayed by the simulator (sim/trace.py) at the run's policy, window, dispatch and
seed; `sim_relative_error` compares predicted with measured mean staleness and
throughput over every run. Run workdirs are kept under --workdir (stores and
checkpoints deleted after each run). Run it with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import gin
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from knittrans_jax import cli  # noqa: E402
from knittrans_jax.job.metrics import read_metrics  # noqa: E402
from knittrans_jax.sim.trace import predict  # noqa: E402
from knittrans_jax.study import matched  # noqa: E402
from bench_throughput import run_bindings, steady_traj_per_s  # noqa: E402  (scripts/)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batch_shape(gin_file: str) -> tuple[int, int]:
  """(G, M) the gin file binds (read with gin's parser, then cleared)."""
  gin.parse_config_files_and_bindings([os.path.join(ROOT, gin_file)], [], skip_unknown=True)
  try:
    return (gin.query_parameter("TrainBatchSpec.groups_per_batch"),
            gin.query_parameter("TrainBatchSpec.num_mini_batches"))
  finally:
    gin.clear_config()


def bindings(policy: str, dispatch: str, window: int, seed: int, train_batches: int) -> list[str]:
  return [*run_bindings(train_batches), f"JobConfig.policy = '{policy}'",
          f"JobConfig.dispatch = '{dispatch}'", f"JobConfig.window = {window}",
          f"JobConfig.seed = {seed}"]


def run_train(gin_file: str, workdir: str, run_bindings_: list[str], what: str) -> dict:
  """One `scripts/train.py` run to completion (its store and checkpoints deleted after);
  returns its summary.json. A failure names `what` and ends with the run's stderr."""
  cmd = [sys.executable, "scripts/train.py", "--gin_file", gin_file, "--workdir", workdir,
         "--overwrite"]
  for b in run_bindings_:
    cmd += ["--gin_bindings", b]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  if proc.returncode:
    raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
  for heavy in ("store", "checkpoints", "weights"):
    shutil.rmtree(os.path.join(workdir, heavy), ignore_errors=True)
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


class Runner:
  """Runs configurations on every seed, once each, keeping their records."""

  def __init__(self, args, bar):
    self.args, self.bar, self.runs = args, bar, []

  def config(self, policy: str, dispatch: str, window: int) -> list[dict]:
    done = [r for r in self.runs if (r["policy"], r["dispatch"], r["window"]) ==
            (policy, dispatch, window)]
    if done:
      return done
    for seed in self.args.seeds:
      self.runs.append(self.one(policy, dispatch, window, seed))
    return self.runs[-len(self.args.seeds):]

  def one(self, policy: str, dispatch: str, window: int, seed: int) -> dict:
    a = self.args
    wd = os.path.join(a.workdir, f"{policy}_{dispatch}_W{window}_s{seed}")
    t = time.perf_counter()
    s = run_train(a.gin_file, wd, [*bindings(policy, dispatch, window, seed, a.train_batches),
                                   *a.gin_bindings],
                  f"{policy} / {dispatch} W={window} seed {seed}")
    skip = a.skip_train_batches * (s["steps"] // a.train_batches)
    rec = {"policy": policy, "dispatch": dispatch, "window": window, "seed": seed,
           "traj_per_s": steady_traj_per_s(wd, skip), "skip_steps": skip,
           "arch_staleness_mean": s["arch_staleness_mean"],
           "arch_staleness_p99": s["arch_staleness_p99"],
           "quota_violations": s["quota_violations"], "wall_s": time.perf_counter() - t,
           "workdir": os.path.relpath(wd, ROOT)}
    # The simulator's replay of the run's own trace at its configuration (sim/trace.py).
    rec["sim"] = predict(wd, policy, window, dispatch, seed, a.train_batches, skip)
    rec["response_len_mean"] = response_len(wd, skip)
    self.bar.set_postfix_str(f"{policy[:5]} {dispatch[:5]} W={window} s{seed}: "
                             f"{rec['traj_per_s']:.0f}/s a={rec['arch_staleness_mean']:.2f} "
                             f"(sim {rec['sim']['traj_per_s']:.0f}/s "
                             f"a={rec['sim']['arch_staleness_mean']:.2f})")
    self.bar.update()
    return rec


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", required=True)
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="more bindings for every run")
  parser.add_argument("--seeds", default="0,1,2", help="JobConfig.seed of every configuration")
  parser.add_argument("--windows", default="1,2,3,4,6,8,12,16",
                      help="constraint-preserving's windows, as multiples of g = G / M")
  parser.add_argument("--dispatch", default="shuffled,quota_aware",
                      help="constraint-preserving's dispatch policies")
  parser.add_argument("--train_batches", type=int, default=20)
  parser.add_argument("--skip_train_batches", type=int, default=3,
                      help="train batches left out of the steady state (start-up)")
  parser.add_argument("--workdir", default=None, help="run directories (default: beside --json)")
  parser.add_argument("--json", required=True)
  parser.add_argument("--resimulate", action="store_true",
                      help="recompute the simulator's replays in --json from the kept traces")
  cli.add_check_flag(parser)
  args = parser.parse_args()
  if args.resimulate and not args.check_args:
    return resimulate(args.json)
  args.seeds = [int(s) for s in args.seeds.split(",")]
  dispatches = args.dispatch.split(",")
  G, M = batch_shape(args.gin_file)
  g = G // M
  windows = sorted({int(float(k) * g) for k in args.windows.split(",")})
  if args.check_args:  # every configuration's job, as its train.py run would build it
    for policy, d, w in [("train_batch", "shuffled", G), *(
        ("constraint_preserving", d, w) for d in dispatches for w in windows)]:
      cli.parse(argparse.Namespace(gin_file=[args.gin_file], gin_bindings=[
          *bindings(policy, d, w, args.seeds[0], args.train_batches), *args.gin_bindings],
          check_args=True))
      cli.check_job()
      gin.clear_config()
    cli.check_only(args)
    return
  args.workdir = args.workdir or os.path.splitext(os.path.abspath(args.json))[0]
  os.makedirs(args.workdir, exist_ok=True)
  t0 = time.perf_counter()
  with tqdm(desc="runs", unit="run") as bar:
    run = Runner(args, bar)
    base = {b: run.config("train_batch", "shuffled", b * G) for b in matched.BASELINE_WINDOWS}
    fastest = max(sum(r["traj_per_s"] for r in rs) / len(rs) for rs in base.values())
    for d in dispatches:
      for w in windows:
        rs = run.config("constraint_preserving", d, w)
        if sum(r["traj_per_s"] for r in rs) / len(rs) >= fastest:
          break
    by_window = matched.reduction_by_baseline_window(run.runs, G, dispatches)
    for entry in by_window.values():  # train-batch at the matched window
      if entry.get("matched_window", 0) >= G:
        run.config("train_batch", "shuffled", entry["matched_window"])
  out = {"command": "python scripts/real_staleness.py " + shlex.join(sys.argv[1:]),
         "gin_file": args.gin_file, "bindings": args.gin_bindings, "G": G, "g": g,
         "seeds": args.seeds, "train_batches": args.train_batches,
         "skip_train_batches": args.skip_train_batches, "windows": windows,
         "dispatch": dispatches, "cpu_count": os.cpu_count(),
         "wall_s": time.perf_counter() - t0, "runs": run.runs}
  report(out, args.json)


def response_len(workdir: str, skip_steps: int) -> float:
  """Mean response tokens a trajectory over the steady-state steps: where the policy
  sets the generation time (long answers end where it samples EOS), a policy that
  learns differently runs at another throughput."""
  recs = read_metrics(workdir)[skip_steps:]
  return float(sum(r["response_len"] * r["trajectories"] for r in recs)
               / sum(r["trajectories"] for r in recs))


def resimulate(path: str) -> None:
  """--resimulate: every run's simulator replay again from its kept trace (after a
  change to the simulator), the rest of the JSON as measured."""
  with open(path) as f:
    out = json.load(f)
  cp = [r for r in out["runs"] if r["policy"] == "constraint_preserving"]
  out.setdefault("dispatch", sorted({r["dispatch"] for r in cp}))  # JSON from before they were kept
  out.setdefault("windows", sorted({r["window"] for r in cp}))
  for r in tqdm(out["runs"], desc="replays", unit="run"):
    wd = os.path.join(ROOT, r["workdir"])
    r["sim"] = predict(wd, r["policy"], r["window"], r["dispatch"], r["seed"],
                       out["train_batches"], r["skip_steps"])
    r["response_len_mean"] = response_len(wd, r["skip_steps"])
  report(out, path)


def report(out: dict, path: str) -> None:
  """Adds the matched reading, the frontiers and the simulator's error to `out` (the
  runs and their shape), writes it to `path` and prints the table."""
  runs, G = out["runs"], out["G"]
  by_window = matched.reduction_by_baseline_window(runs, G, out["dispatch"])
  sim_err = {
      "arch_staleness_mean": matched.relative_errors(
          (r["sim"]["arch_staleness_mean"], r["arch_staleness_mean"]) for r in runs),
      "traj_per_s": matched.relative_errors(
          (r["sim"]["traj_per_s"], r["traj_per_s"]) for r in runs)}
  both = matched.relative_errors(
      [(r["sim"][k], r[k]) for r in runs for k in ("arch_staleness_mean", "traj_per_s")])
  out.update(reduction_by_baseline_window=by_window, sim_relative_error={**both, **sim_err},
             frontier=matched.frontier(runs),
             sim_frontier=matched.frontier({**r, **r["sim"]} for r in runs))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1, default=float)
  print(f"\n{out['gin_file']}: G = {G}, g = {out['g']}, seeds {out['seeds']}, {len(runs)} runs, "
        f"{out['wall_s']:.0f} s")
  for key, e in by_window.items():
    thr = e["baseline_traj_per_s"]
    head = (f"  train_batch W={key}: {thr['mean']:.1f} traj/s [{thr['min']:.1f}, "
            f"{thr['max']:.1f}], staleness {e['baseline_arch_staleness_mean']['mean']:.2f}")
    if not e["matched"]:
      print(head + "; no constraint-preserving window reached its throughput (see frontier)")
      continue
    c = e["candidates"][e["dispatch"]]
    print(head + f" -> constraint_preserving+{e['dispatch']} W={e['matched_window']}: "
          f"{c['traj_per_s']['mean']:.1f} traj/s, staleness {c['arch_staleness_mean']['mean']:.2f}"
          f", reduction {e['mean']:.3f} [{e['min']:.3f}, {e['max']:.3f}]"
          f"{'' if e['within_spread'] else ' (throughput above the baseline beyond its spread)'}")
  print(f"  simulator vs job: relative error mean {both.get('mean', float('nan')):.3f}, "
        f"max {both.get('max', float('nan')):.3f} (staleness "
        f"{sim_err['arch_staleness_mean'].get('mean', float('nan')):.3f}, throughput "
        f"{sim_err['traj_per_s'].get('mean', float('nan')):.3f})")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
