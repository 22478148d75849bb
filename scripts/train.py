"""The disaggregated RL training job (or its colocated reference).

  python scripts/train.py --gin_file configs/text_grpo_tiny.gin --workdir runs/NAME
  python scripts/train.py ... --gin_bindings "JobConfig.mode = 'colocated'"
  python scripts/train.py ... --gin_bindings "JobConfig.policy = 'train_batch'"
  python scripts/train.py ... --resume        # continue from the latest checkpoint

Several trainer processes (jax.distributed; see docs/distributed.md and
scripts/launch_local.py, which starts them all on one machine):
  python scripts/train.py ... --coordinator_address HOST:PORT --num_processes N --process_id I \
      [--host_address THIS_HOST_ADDRESS]

Writes WORKDIR/{config.gin, operative_config.gin, metrics.jsonl, summary.json,
checkpoints/, store/, weights/} and prints the summary as a table.
"""
from __future__ import annotations

import argparse
import shutil

from knittrans_jax import gin_cli
from knittrans_jax.job import distributed


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  gin_cli.add_flags(parser, workdir_default="runs/text_grpo_tiny")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  parser.add_argument("--overwrite", action="store_true", help="delete WORKDIR first")
  parser.add_argument("--coordinator_address", default=None,
                      help="host:port of process 0's coordination service (jax.distributed)")
  parser.add_argument("--num_processes", type=int, default=1, help="trainer processes in all")
  parser.add_argument("--process_id", type=int, default=0, help="this trainer process's index")
  parser.add_argument("--host_address", default=None,
                      help="this host's address as the other trainer hosts reach it (the CPU "
                      "collectives listen there; default: the address of the hostname)")
  args = parser.parse_args()
  if args.overwrite and args.resume:
    parser.error("--overwrite and --resume exclude each other")
  try:
    setup = distributed.ProcessSetup(args.coordinator_address, args.num_processes, args.process_id,
                                     args.host_address)
  except ValueError as e:
    parser.error(str(e))
  if args.overwrite and setup.process_id == 0:
    shutil.rmtree(args.workdir, ignore_errors=True)
  distributed.initialize(setup)  # before any other JAX work
  from knittrans_jax.job.run import run  # noqa: E402  (imports JAX models)
  if not args.gin_file:
    args.gin_file = ["configs/text_grpo_tiny.gin"]
  gin_cli.parse(args)
  summary = run(args.workdir, resume=args.resume)
  if summary is None:  # a follower process: the controller prints the summary
    return
  print()
  for key, value in summary.items():
    print(f"  {key:<28} {value:.4g}" if isinstance(value, float) else f"  {key:<28} {value}")


if __name__ == "__main__":
  main()
