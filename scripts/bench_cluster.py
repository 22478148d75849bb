"""The same job on Ray and as local processes on this machine, side by side.

  python scripts/bench_cluster.py --json runs/bench_cluster.json

Both run scripts/train.py as a fresh process on the same gin config (default
configs/text_grpo_tiny.gin, `--train_batches` train batches): `local` with
JobConfig.cluster = 'local' (the trainer in the process, rollout workers its child
processes), `ray` with a local Ray cluster started by the run on 127.0.0.2 (one
trainer actor with as many devices as the local process has, the same number of
rollout actors). The runs alternate, `--repeats` of each.

Per run: steady-state throughput, trajectories trained after step `--warmup` over the
time from that step to the last (metrics.jsonl's time_s: compilation and start-up are
outside it); time to the first step; for Ray also `startup_s`, the seconds before the
train loop (ray.init and the trainer actors' set-up: ray_wall_s - wall_s).

Then one more Ray run on configs/text_grpo_test.gin measures liveness: a rollout
actor SIGKILLed after step 1 (`detect_dead_worker_s`: from the kill to the driver's
line that it died, read from its output as it comes) and another SIGSTOPped after
step 2 (`detect_hung_worker_s`, with RayConfig.call_deadline_s = `--deadline_s`: a
hang is caught by its call's deadline, so this is about the deadline plus the kill).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = ["JobConfig.cluster = 'ray'", "RayConfig.node_address = '127.0.0.2'"]


def train(workdir: str, gin_file: str, bindings: list[str], on_line=None, on_step=None):
  """Runs scripts/train.py; returns (summary, records, seconds to the first step)."""
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--gin_file", gin_file,
         "--workdir", workdir, "--overwrite"]
  for b in bindings:
    cmd += ["--gin_bindings", b]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
  env.pop("XLA_FLAGS", None)  # one CPU device, local and on Ray alike
  t0 = time.monotonic()
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  tail, first = [], []

  def read():
    for line in proc.stdout:
      tail.append(line)
      del tail[:-200]
      if on_line:
        on_line(line)
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  metrics, done_steps = os.path.join(workdir, "metrics.jsonl"), 0
  while proc.poll() is None:
    if os.path.exists(metrics):
      with open(metrics) as f:
        steps = sum(1 for line in f if line.strip())
      if steps and not first:
        first.append(time.monotonic() - t0)
      if on_step and steps > done_steps:
        on_step(steps)
      done_steps = steps
    time.sleep(0.05)
  reader.join(timeout=10)
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(tail)[-4000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(metrics) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return summary, records, first[0] if first else None


def steady(records: list[dict], warmup: int) -> float:
  after = records[warmup:]
  seconds = after[-1]["time_s"] - records[warmup - 1]["time_s"]
  return sum(r["trajectories"] for r in after) / seconds


def liveness(work: str, deadline_s: float) -> dict:
  events, pids = {}, {}

  def pid(role):
    with open(os.path.join(work, "logs", f"{role}.pid")) as f:
      return int(f.read())

  def on_step(steps):
    if steps >= 1 and "kill" not in events:
      pids["rollout0"] = pid("rollout0")
      os.kill(pids["rollout0"], signal.SIGKILL)
      events["kill"] = time.monotonic()
    if steps >= 2 and "stop" not in events:
      pids["rollout1"] = pid("rollout1")
      os.kill(pids["rollout1"], signal.SIGSTOP)
      events["stop"] = time.monotonic()

  def on_line(line):
    if re.search(r"rollout actor 0 died", line):
      events.setdefault("died", time.monotonic())
    if re.search(r"rollout actor 1 hung", line):
      events.setdefault("hung", time.monotonic())
  try:
    summary, _, _ = train(work, "configs/text_grpo_test.gin", [
        *RAY, "JobConfig.groups_per_call = 1", "JobConfig.window = 8",
        f"RayConfig.call_deadline_s = {deadline_s}"], on_line=on_line, on_step=on_step)
  finally:
    for p in pids.values():
      try:
        os.kill(p, signal.SIGKILL)
      except ProcessLookupError:
        pass
  return dict(detect_dead_worker_s=events["died"] - events["kill"] if "died" in events else None,
              detect_hung_worker_s=events["hung"] - events["stop"] if "hung" in events else None,
              call_deadline_s=deadline_s, liveness_run_steps=summary["steps"],
              liveness_run_worker_restarts=summary["worker_restarts"])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", default="runs/bench_cluster.json")
  parser.add_argument("--gin_file", default="configs/text_grpo_tiny.gin")
  parser.add_argument("--train_batches", type=int, default=6)
  parser.add_argument("--warmup", type=int, default=3, help="steps left out of the steady state")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--deadline_s", type=float, default=5.0)
  args = parser.parse_args()
  tmp = tempfile.mkdtemp(prefix="bench_cluster_")
  # No held-out evaluation: it runs in a local trainer process only, and is not the system.
  bindings = [f"JobConfig.train_batches = {args.train_batches}", "EvalConfig.every_steps = 0"]
  runs = {"local": [], "ray": []}
  try:
    for k in range(args.repeats):
      for name in ("local", "ray"):
        work = os.path.join(tmp, f"{name}{k}")
        summary, records, first = train(work, args.gin_file,
                                        bindings + (RAY if name == "ray" else []))
        run = dict(traj_per_s=steady(records, args.warmup), first_step_s=first,
                   wall_s=summary["wall_s"], steps=summary["steps"])
        if name == "ray":
          run["startup_s"] = summary["ray_wall_s"] - summary["wall_s"]
        runs[name].append(run)
        print(f"{name} run {k}: {run}", flush=True)
    live = liveness(os.path.join(tmp, "liveness"), args.deadline_s)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  med = lambda name, key: statistics.median(r[key] for r in runs[name])  # noqa: E731
  out = {
      "config": dict(gin_file=args.gin_file, train_batches=args.train_batches,
                     warmup_steps=args.warmup, repeats=args.repeats, cpus=os.cpu_count()),
      "local": dict(traj_per_s=med("local", "traj_per_s"),
                    first_step_s=med("local", "first_step_s"), runs=runs["local"]),
      "ray": dict(traj_per_s=med("ray", "traj_per_s"), first_step_s=med("ray", "first_step_s"),
                  startup_s=med("ray", "startup_s"), runs=runs["ray"], **live),
  }
  out["ray_over_local_traj_per_s"] = out["ray"]["traj_per_s"] / out["local"]["traj_per_s"]
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=2)
  print(json.dumps({k: v for k, v in out.items() if k != "config"}, indent=1, default=str))
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
