"""The disaggregated RL training job (or its colocated reference).

  python scripts/train.py --gin_file configs/text_grpo_tiny.gin --workdir runs/NAME
  python scripts/train.py ... --gin_bindings "JobConfig.mode = 'colocated'"
  python scripts/train.py ... --gin_bindings "JobConfig.policy = 'train_batch'"
  python scripts/train.py ... --resume        # continue from the latest checkpoint

Writes WORKDIR/{config.gin, operative_config.gin, metrics.jsonl, summary.json,
checkpoints/, store/, weights/} and prints the summary as a table.
"""
from __future__ import annotations

import argparse
import shutil

from knittrans_jax import gin_cli
from knittrans_jax.job.run import run


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  gin_cli.add_flags(parser, workdir_default="runs/text_grpo_tiny")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  parser.add_argument("--overwrite", action="store_true", help="delete WORKDIR first")
  args = parser.parse_args()
  if args.overwrite and args.resume:
    parser.error("--overwrite and --resume exclude each other")
  if args.overwrite:
    shutil.rmtree(args.workdir, ignore_errors=True)
  if not args.gin_file:
    args.gin_file = ["configs/text_grpo_tiny.gin"]
  gin_cli.parse(args)
  summary = run(args.workdir, resume=args.resume)
  print()
  for key, value in summary.items():
    print(f"  {key:<28} {value:.4f}" if isinstance(value, float) else f"  {key:<28} {value}")


if __name__ == "__main__":
  main()
