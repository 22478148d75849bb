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
real_job (scripts/real_staleness.py, configs/agentic_tails.gin and text_long_tails.gin):
  real_frontier_<workload>.png  staleness against throughput per configuration,
                           measured and the simulator's replay of the same runs
learning (scripts/study.py, configs/study/staleness.gin; 10 seeds per configuration):
  study_learning_curves.png  held-out reward of the current policy, mean and 95% band
  study_dose_response.png    final reward against mean architectural staleness
learning_agentic (scripts/study.py, configs/study/agentic.gin; 10 seeds per configuration):
  study_agentic_learning_curves.png  the same on multi-turn agentic episodes
learning_peers (scripts/study.py, configs/study/peers.gin; 10 seeds per configuration):
  study_peers_learning_curves.png  constraint-preserving against the strongest peer rule
                           at its throughput and synchronous execution
transfer (scripts/bench_transfer.py, text and vlm):
  transfer_latency.png     exposed and raw transfer latency, baseline vs on-demand
peers (simulator on paper_text.gin and the agentic job's trace; the real job where
  scripts/real_peers.py has written runs/figures/real_peers_agentic.json):
  peers_<workload>.png     staleness against throughput for every peer rule over its
                           own knob beside constraint-preserving's window sweep, and
                           each rule's quota error and tail bias
multimodal (scripts/bench_multimodal.py):
  multimodal_step.png      transfer + training per mini-batch: baseline, both
                           ablations, knittrans
figures/summary.md holds every number drawn, and numbers.json all of them.

Each group's runs, figure and summary.md section live in scripts/figures_<group>.py
(what they share: scripts/figures_common.py); this script picks the groups and keeps
numbers.json and summary.md.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import figures_learning
import figures_multimodal
import figures_peers
import figures_real_job
import figures_runs
import figures_staleness
import figures_transfer
from knittrans_jax import gin_cli

SECTIONS = {"staleness": figures_staleness.staleness_section,
            "runs": figures_runs.runs_section,
            "real_job": figures_real_job.real_job_section,
            "learning": figures_learning.learning_section,
            "learning_agentic": figures_learning.learning_agentic_section,
            "learning_peers": figures_learning.learning_peers_section,
            "transfer": figures_transfer.transfer_section,
            "peers": figures_peers.peers_section,
            "multimodal": figures_multimodal.multimodal_section}


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


# --quick's main simulator sweep: 6 train batches a run, not paper_text.gin's 20.
QUICK_SIM_BATCHES = 6
GROUPS = ("staleness", "runs", "real_job", "learning", "learning_agentic", "transfer",
          "multimodal", "peers", "learning_peers")


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
                      help="train batches per tiny run (default 100; quick 4, five of the runs)")
  parser.add_argument("--reuse_real_job", action="store_true",
                      help="real_job group: read the real_staleness_*.json already in --work "
                      "(each records the command that made it) instead of rerunning them")
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
                     + (["--reuse_real_job"] if args.reuse_real_job else [])
                     + ([f"--runs_matching '{args.runs_matching}'"] if args.runs_matching else [])
                     + ([f"--train_batches {args.train_batches}"] if args.train_batches else [])
                     + ([f"--sensitivity_batches {args.sensitivity_batches}"]
                        if args.sensitivity_batches else []))
  sens = args.sensitivity_batches or (3 if args.quick else 10)
  batches = args.train_batches or (4 if args.quick else 100)
  makers = {
      "staleness": lambda: figures_staleness.staleness(
          args.out, sens, (0,) if args.quick else (0, 1, 2, 3, 4),
          QUICK_SIM_BATCHES if args.quick else None),
      "runs": lambda: figures_runs.real_runs(args.out, os.path.abspath(args.work), batches,
                                             args.runs_matching, numbers.get("runs"), args.quick),
      "real_job": lambda: figures_real_job.real_job(args.out, os.path.abspath(args.work),
                                                    args.quick, args.reuse_real_job),
      "learning": lambda: figures_learning.learning(args.out, os.path.abspath(args.work),
                                                    args.quick),
      "learning_agentic": lambda: figures_learning.learning(
          args.out, os.path.abspath(args.work), args.quick, "learning_agentic"),
      "transfer": lambda: figures_transfer.transfer(args.out, os.path.abspath(args.work),
                                                    args.quick),
      "multimodal": lambda: figures_multimodal.multimodal(args.out, os.path.abspath(args.work),
                                                          args.quick),
      "peers": lambda: figures_peers.peers(args.out, os.path.abspath(args.work), args.quick),
      "learning_peers": lambda: figures_learning.learning(
          args.out, os.path.abspath(args.work), args.quick, "learning_peers"),
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
