"""The peers' admission rules in the real job, beside constraint-preserving admission
(issue 60, part 3): each rule over a few settings of its own knob, ours over windows,
on the same seeds, one run at a time.

  python scripts/real_peers.py --gin_file configs/agentic_tails.gin --seeds 0,1,2 \
      --train_batches 20 --skip_train_batches 3 --json runs/figures/real_peers_agentic.json

Runs `scripts/train.py` (held-out evaluation off), each seed of a configuration before
the next: constraint-preserving admission (--dispatch) at --windows x g, then each
rule of --rules at its settings (RULE_SETTINGS; a rule whose gate binds gets the
largest window, a rule without one the window its bound implies, as sim/peers.py
does). Throughput is steady state (scripts/bench_throughput.py's, the first
--skip_train_batches train batches left out); staleness, quota error and tail bias
are the run's own (summary.json). The matched reduction, frontier and costs are
sim/peers.py's summary over these runs; each run is also replayed by the simulator
from its own trace (sim/trace.py), and its error reported. Run it with nothing else
on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import gin
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from knittrans_jax import cli  # noqa: E402
from knittrans_jax.admission import POLICIES  # noqa: E402
from knittrans_jax.sim import peers as P  # noqa: E402
from knittrans_jax.sim.trace import predict  # noqa: E402
from knittrans_jax.study import matched  # noqa: E402
from bench_throughput import run_bindings, steady_traj_per_s  # noqa: E402  (scripts/)
from real_staleness import batch_shape, run_train  # noqa: E402  (scripts/)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each rule's settings in the real job: version gates and bounds of 1, 3 and 7 steps
# (2g, 4g and 8g in flight: G / 2, G and 2G on the agentic workload), verl's counter
# at 4g, 8g, 16g, prime-rl's window at 2g, 4g, 8g: the span where the trace-mode
# simulator (scripts/figures_peers.py) put the rules' throughputs beside ours; never
# chosen from these runs.
RULE_SETTINGS = {"areal": (1, 3, 7), "verl": (0.0, 1.0, 3.0), "nemo_weight_fifo": (1, 3, 7),
                 "nemo_windowed": (1, 3, 7), "prime_rl": (2, 4, 8), "tinker_discard": (1, 3, 7)}


def configurations(rules, windows, dispatches, g: int) -> list[dict]:
  """Every run's configuration: ours at each window, then each rule at each setting."""
  out = [{"rule": f"constraint_preserving+{d}" if d != "shuffled" else "constraint_preserving",
          "policy": "constraint_preserving", "dispatch": d, "window": w, "options": {}}
         for d in dispatches for w in windows]
  largest = max(windows)
  for name in rules:
    rule = P.RULES[name]
    for v in RULE_SETTINGS[name]:
      out.append({"rule": name, "policy": name, "dispatch": rule.dispatch,
                  "window": rule.window_in(v, g, largest), "options": rule.options(v)})
  return out


def bindings(c: dict, seed: int, train_batches: int) -> list[str]:
  return [*run_bindings(train_batches), f"JobConfig.policy = '{c['policy']}'",
          f"JobConfig.dispatch = '{c['dispatch']}'", f"JobConfig.window = {c['window']}",
          f"JobConfig.seed = {seed}",
          *(f"{POLICIES[c['policy']].__name__}.{k} = {v!r}" for k, v in c["options"].items())]


def run_one(args, c: dict, seed: int) -> dict:
  opts = "_".join(f"{v}" for v in c["options"].values())
  wd = os.path.join(args.workdir, f"{c['rule']}_W{c['window']}_{opts}_s{seed}".replace("+", "-"))
  t = time.perf_counter()
  s = run_train(args.gin_file, wd, [*bindings(c, seed, args.train_batches), *args.gin_bindings],
                f"{c['rule']} W={c['window']} {c['options']} seed {seed}")
  skip = args.skip_train_batches * (s["steps"] // args.train_batches)
  dropped = {k: v for k, v in s["groups"].items() if k not in ("trained", "failed")}
  rec = {"rule": c["rule"], "policy": c["policy"], "dispatch": c["dispatch"],
         "window": c["window"], "options": s.get("policy_options") or c["options"], "seed": seed,
         "throughput_traj_per_s": steady_traj_per_s(wd, skip), "skip_steps": skip,
         "arch_staleness_mean": s["arch_staleness_mean"],
         "arch_staleness_p99": s["arch_staleness_p99"], "quota_error": s["quota_error"],
         "quota_violations": s["quota_violations"], "tail_bias": s["tail_bias"],
         "dropped": dropped, "stalled": None, "wall_s": time.perf_counter() - t,
         "workdir": os.path.relpath(wd, ROOT)}
  rec["sim"] = predict(wd, c["policy"], c["window"], c["dispatch"], seed, args.train_batches,
                       skip, c["options"])
  return rec


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", required=True)
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="more bindings for every run")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--rules", default=",".join(RULE_SETTINGS),
                      help=f"peer rules to run (of {', '.join(RULE_SETTINGS)})")
  parser.add_argument("--windows", default="1,2,4,6,8,12,16",
                      help="constraint-preserving's windows, as multiples of g = G / M")
  parser.add_argument("--dispatch", default="quota_aware",
                      help="constraint-preserving's dispatch policies")
  parser.add_argument("--train_batches", type=int, default=20)
  parser.add_argument("--skip_train_batches", type=int, default=3)
  parser.add_argument("--workdir", default=None, help="run directories (default: beside --json)")
  parser.add_argument("--json", required=True)
  parser.add_argument("--resummarize", action="store_true",
                      help="recompute the summary in --json from its runs (after a change to "
                      "sim/peers.py's summary), the runs as measured")
  cli.add_check_flag(parser)
  args = parser.parse_args()
  if args.resummarize and not args.check_args:
    with open(args.json) as f:
      out = json.load(f)
    return report(out, list(out["settings"]), args.json)
  args.seeds = [int(s) for s in args.seeds.split(",")]
  rules = [r for r in args.rules.split(",") if r]
  unknown = sorted(set(rules) - set(RULE_SETTINGS))
  if unknown:
    parser.error(f"--rules: unknown {unknown}; choose of {sorted(RULE_SETTINGS)}")
  G, M = batch_shape(args.gin_file)
  g = G // M
  windows = sorted({int(float(k) * g) for k in args.windows.split(",")})
  confs = configurations(rules, windows, args.dispatch.split(","), g)
  if args.check_args:  # every configuration's job, as its train.py run would build it
    for c in confs:
      cli.parse(argparse.Namespace(gin_file=[args.gin_file], gin_bindings=[
          *bindings(c, args.seeds[0], args.train_batches), *args.gin_bindings], check_args=True))
      cli.check_job()
      gin.clear_config()
    cli.check_only(args)
    return
  args.workdir = args.workdir or os.path.splitext(os.path.abspath(args.json))[0]
  os.makedirs(args.workdir, exist_ok=True)
  t0 = time.perf_counter()
  runs = []
  with tqdm(total=len(confs) * len(args.seeds), desc="runs", unit="run") as bar:
    for c in confs:
      for seed in args.seeds:
        r = run_one(args, c, seed)
        runs.append(r)
        bar.set_postfix_str(f"{c['rule'][:12]} W={c['window']} s{seed}: "
                            f"{r['throughput_traj_per_s']:.0f}/s a={r['arch_staleness_mean']:.2f}")
        bar.update()
  out = {"command": "python scripts/real_peers.py " + shlex.join(sys.argv[1:]),
         "gin_file": args.gin_file, "bindings": args.gin_bindings, "G": G, "g": g,
         "seeds": args.seeds, "train_batches": args.train_batches,
         "skip_train_batches": args.skip_train_batches, "windows": windows,
         "settings": {r: RULE_SETTINGS[r] for r in rules}, "cpu_count": os.cpu_count(),
         "wall_s": time.perf_counter() - t0, "runs": runs}
  report(out, rules, args.json)


def report(out: dict, rules: list[str], path: str) -> None:
  """Adds the rules' summary (frontier, costs, matched reductions) and the simulator's
  error on these runs to `out`, writes it to `path` and prints the table."""
  runs = out["runs"]
  summary = P.summarize_rules(runs, rules)
  err = {k: matched.relative_errors((r["sim"][s], r[k]) for r in runs)
         for k, s in (("arch_staleness_mean", "arch_staleness_mean"),
                      ("throughput_traj_per_s", "traj_per_s"))}
  out["summary"] = {"rules": summary, "seeds": out["seeds"],
                    "train_batches": out["train_batches"], "sim_relative_error": err}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1, default=float)
  print(f"\n{out['gin_file']}: G = {out['G']}, g = {out['g']}, seeds {out['seeds']}, "
        f"{len(runs)} runs, {out['wall_s']:.0f} s")
  for name, r in summary.items():
    for f in r["frontier"]:
      m = f.get("matched_reduction") or {}
      red = "" if not m else (f"reduction {m['mean']:.3f} [{m['min']:.3f}, {m['max']:.3f}]"
                              if m.get("mean") is not None else m.get("reason"))
      print(f"  {name:34s} {str(f['setting']):60s} {f['traj_per_s']:7.1f}/s "
            f"a={f['arch_staleness_mean']:.2f} quota {f['quota_error_mean'] or 0:.3f} "
            f"trained {f['trained_share']:.2f} {red}")
  print(f"  simulator vs job, relative error: staleness "
        f"{err['arch_staleness_mean'].get('mean', float('nan')):.3f}, throughput "
        f"{err['throughput_traj_per_s'].get('mean', float('nan')):.3f}")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
