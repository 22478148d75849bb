"""The disaggregated RL training job (or its colocated reference).

  python scripts/train.py --gin_file configs/text_grpo_tiny.gin --workdir runs/NAME
  python scripts/train.py ... --gin_bindings "JobConfig.mode = 'colocated'"
  python scripts/train.py ... --gin_bindings "JobConfig.policy = 'train_batch'"
  python scripts/train.py ... --resume        # continue from the latest checkpoint

On Ray (trainer and rollout actors; docs/distributed.md), a local cluster started for
the run or an existing one:
  python scripts/train.py ... --gin_bindings "JobConfig.cluster = 'ray'" \
      --gin_bindings "RayConfig.trainers = 2" [--gin_bindings "RayConfig.address = 'HEAD:6379'"]

Writes WORKDIR/{config.gin, operative_config.gin, metrics.jsonl, summary.json,
checkpoints/, store/, weights/} and prints the summary as a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

from knittrans_jax import cli, cpu_profile


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_flags(parser, workdir_default="runs/text_grpo_tiny")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  parser.add_argument("--overwrite", action="store_true", help="delete WORKDIR first")
  parser.add_argument("--profile", action="store_true",
                      help="CPU time by phase in every process of the run (knittrans_jax/"
                           "cpu_profile.py): WORKDIR/profile.json and a table")
  args = parser.parse_args()
  if args.overwrite and args.resume:
    parser.error("--overwrite and --resume exclude each other")
  if not args.gin_file:
    args.gin_file = ["configs/text_grpo_tiny.gin"]
  if args.check_args:  # the job's set-up checks, with no work dir touched
    cli.parse(args)
    cli.check_job()
    cli.check_only(args)
    return
  if args.overwrite:
    shutil.rmtree(args.workdir, ignore_errors=True)
  if args.profile:  # before the imports, which are start-up
    profile_dir = os.path.join(args.workdir, "profile")
    shutil.rmtree(profile_dir, ignore_errors=True)
    os.environ[cpu_profile.ENV] = os.path.abspath(profile_dir)  # the workers inherit it
    cpu_profile.start("trainer", compute_phase="train_step")
  from knittrans_jax.launch import run  # noqa: E402  (imports JAX models)
  cli.parse(args)
  summary = run(args.workdir, resume=args.resume)
  if args.profile:
    report = cpu_profile.summarize(profile_dir, summary["trajectories"], summary["wall_s"],
                                   len(os.sched_getaffinity(0)))
    with open(os.path.join(args.workdir, "profile.json"), "w") as f:
      json.dump(report, f, indent=1)
    print(cpu_profile.table(report))
  print()
  start, last = summary.get("eval_start"), summary.get("eval_last")
  if last:  # the headline: the policy on held-out prompts, not its stale samples' reward
    def fmt(e):
      return "n/a" if e is None else f"sampled {e['sampled']:.3f}, greedy {e['greedy']:.3f}"
    print(f"held-out evaluation (prompts training never sees; overlap "
          f"{summary.get('eval_train_overlap')}): start {fmt(start)} -> end {fmt(last)}")
  for key, value in summary.items():
    print(f"  {key:<28} {value:.4g}" if isinstance(value, float) else f"  {key:<28} {value}")


if __name__ == "__main__":
  main()
