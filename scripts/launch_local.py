"""Starts a multi-process trainer on this machine: N processes of scripts/train.py
under jax.distributed (CPU devices, gloo collectives), process 0 running the
controller and the rollout workers.

  python scripts/launch_local.py --processes 2 --devices_per_process 4 -- \
      --gin_file configs/text_grpo_tiny.gin --workdir runs/dist2 --overwrite

Everything after `--` goes to scripts/train.py (every process gets the same).
Process 0 prints to this terminal; process p > 0 writes WORKDIR/logs/trainer{p}.log.
If any process fails, the others are stopped and its log's tail is printed.
Ctrl-C reaches process 0, which checkpoints and tells the others to finish.
On a real cluster run scripts/train.py once per host instead (docs/distributed.md).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def child_env(devices: int) -> dict:
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def tail(path: str, lines: int = 30) -> str:
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except FileNotFoundError:
    return "(no log)"


def launch(processes: int, devices_per_process: int, train_args: list[str],
           port: int | None = None, poll_s: float = 0.2) -> int:
  """Runs the trainer processes to the end; returns the first non-zero exit code (or 0)."""
  if processes < 1 or devices_per_process < 1:
    raise ValueError(f"processes = {processes} and devices_per_process = {devices_per_process} "
                     "must be >= 1")
  wd = argparse.ArgumentParser(add_help=False)
  wd.add_argument("--workdir", default="runs/text_grpo_tiny")
  wd.add_argument("--overwrite", action="store_true")
  known, rest = wd.parse_known_args(train_args)
  if known.overwrite and "--resume" in rest:
    raise ValueError("--overwrite and --resume exclude each other (nothing was deleted)")
  if known.overwrite:  # here, once, before any process writes into the work dir
    shutil.rmtree(known.workdir, ignore_errors=True)
  logs = os.path.join(known.workdir, "logs")
  os.makedirs(logs, exist_ok=True)
  address = f"localhost:{port or free_port()}"
  env = child_env(devices_per_process)
  procs, log_paths = [], []
  # Handlers first, then the children: a signal never finds them unsupervised.
  # Ctrl-C is forwarded once to process 0 (every child has its own session, so the
  # terminal's SIGINT reaches only this launcher); SIGTERM stops them all.
  def on_sigint(*_):
    if procs:
      procs[0].send_signal(signal.SIGINT)

  def on_sigterm(*_):
    raise SystemExit(143)  # the finally below stops the children

  def stop_all():
    for q in procs:
      if q.poll() is None:
        q.terminate()
    deadline = time.monotonic() + 10
    for q in procs:
      try:
        q.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        q.kill()
        q.wait()

  previous = (signal.signal(signal.SIGINT, on_sigint), signal.signal(signal.SIGTERM, on_sigterm))
  try:
    for p in range(processes):
      cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--workdir", known.workdir,
             *rest]
      if processes > 1:
        cmd += ["--coordinator_address", address, "--num_processes", str(processes),
                "--process_id", str(p)]
      if p == 0:
        out, path = None, None
      else:
        path = os.path.join(logs, f"trainer{p}.log")
        out = open(path, "w")
      procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    start_new_session=True))
      log_paths.append(path)

    while True:
      codes = [q.poll() for q in procs]
      failed = [p for p, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        p = failed[0]
        print(f"\ntrainer process {p} exited with code {codes[p]}; stopping the others",
              file=sys.stderr)
        if log_paths[p]:
          print(f"--- {log_paths[p]} (tail) ---\n{tail(log_paths[p])}", file=sys.stderr)
        stop_all()
        return codes[p]
      if all(c == 0 for c in codes):
        return 0
      time.sleep(poll_s)
  finally:
    signal.signal(signal.SIGINT, previous[0])
    signal.signal(signal.SIGTERM, previous[1])
    if any(q.poll() is None for q in procs):
      stop_all()


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, default=2, help="trainer processes")
  parser.add_argument("--devices_per_process", type=int, default=4,
                      help="CPU devices each process sees (XLA host platform device count)")
  parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  args, train_args = parser.parse_known_args()
  if train_args and train_args[0] == "--":
    train_args = train_args[1:]
  try:
    code = launch(args.processes, args.devices_per_process, train_args, args.port)
  except ValueError as e:
    parser.error(str(e))
  sys.exit(code)


if __name__ == "__main__":
  main()
