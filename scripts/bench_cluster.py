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

CPU over the same steady state (`cpu`): every thread of every process of the run (the
train.py process and its descendants: on Ray the GCS, the raylet, the dashboard's
processes, the log monitor, the workers and actors), /proc/PID/task/TID/stat read when
step `--warmup` appears in metrics.jsonl and again at the last step. On Ray each
thread is ours or Ray's runtime (`ray_thread_owner`): `ray.runtime_cpu_s` is Ray's,
`ray.runtime_cpu_share` that over all the run's CPU-seconds. Python threads are told
apart through scripts/thread_names (each names its target's module in a registry).

Then one more Ray run on configs/text_grpo_test.gin measures liveness: a rollout
actor SIGKILLed after step 1 (`detect_dead_worker_s`: from the kill to the driver's
line that it died, read from its output as it comes) and another SIGSTOPped after
step 2 (`detect_hung_worker_s`, with RayConfig.call_deadline_s = `--deadline_s`: a
hang is caught by its call's deadline, so this is about the deadline plus the kill).
`--no_liveness` leaves it out.
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
sys.path.insert(0, ROOT)
from knittrans_jax.bench.proc_cpu import (CPU_METHOD, cpu_sample, cpu_split,  # noqa: E402
                                          our_actors, thread_registry)
from knittrans_jax.bench.timing import steady_rate  # noqa: E402
from knittrans_jax.job.metrics import read_metrics  # noqa: E402

RAY = ["JobConfig.cluster = 'ray'", "RayConfig.node_address = '127.0.0.2'"]
THREAD_NAMES = os.path.join(ROOT, "scripts", "thread_names")


def train(workdir: str, gin_file: str, bindings: list[str], on_line=None, on_step=None,
          cpu_from_step: int | None = None):
  """Runs scripts/train.py; returns (summary, records, seconds to the first step, the
  CPU split from step `cpu_from_step` to the last, or None)."""
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--gin_file", gin_file,
         "--workdir", workdir, "--overwrite"]
  for b in bindings:
    cmd += ["--gin_bindings", b]
  threads_dir = tempfile.mkdtemp(prefix="threads_", dir=os.path.dirname(workdir))
  path = os.pathsep.join(p for p in (THREAD_NAMES, os.environ.get("PYTHONPATH")) if p)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path,
         "KNITTRANS_THREAD_LOG": threads_dir}
  env.pop("XLA_FLAGS", None)  # one CPU device, local and on Ray alike
  t0 = time.monotonic()
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  tail, first, samples = [], [], {}

  def read():
    for line in proc.stdout:
      tail.append(line)
      del tail[:-200]
      if on_line:
        on_line(line)
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  done_steps = 0
  while proc.poll() is None:
    steps = len(read_metrics(workdir, partial=True))
    if steps and not first:
      first.append(time.monotonic() - t0)
    if steps > done_steps:
      if cpu_from_step is not None and steps >= cpu_from_step:
        sample = (steps, cpu_sample(proc.pid))  # the window: the first and the latest
        samples["end" if "start" in samples else "start"] = sample
      if on_step:
        on_step(steps)
    done_steps = steps
    time.sleep(0.05)
  reader.join(timeout=10)
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(tail)[-4000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  records = read_metrics(workdir)
  cpu = None
  if "end" in samples:
    ours = None  # a local run: every process is ours
    if "JobConfig.cluster = 'ray'" in bindings:
      ours = our_actors(workdir) | {proc.pid}
    cpu = cpu_split(samples["start"][1], samples["end"][1], thread_registry(threads_dir), ours)
    cpu["steps"] = [samples["start"][0], samples["end"][0]]
    cpu["trajectories"] = sum(r["trajectories"] for r in records[cpu["steps"][0]:cpu["steps"][1]])
  shutil.rmtree(threads_dir, ignore_errors=True)
  return summary, records, first[0] if first else None, cpu


def steady(records: list[dict], warmup: int) -> float:
  return steady_rate([r["time_s"] for r in records], [r["trajectories"] for r in records], warmup)


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
    summary, _, _, _ = train(work, "configs/text_grpo_test.gin", [
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


def table(out: dict) -> str:
  local, ray = out["local"], out["ray"]
  f = lambda v, fmt="{:.2f}": "-" if v is None else fmt.format(v)  # noqa: E731
  rows = [("steady-state trajectories/s (median)", f(local["traj_per_s"], "{:.1f}"),
           f(ray["traj_per_s"], "{:.1f}")),
          ("Ray / local trajectories/s", "", f(out["ray_over_local_traj_per_s"])),
          ("seconds to the first step", f(local["first_step_s"], "{:.1f}"),
           f(ray["first_step_s"], "{:.1f}")),
          ("startup_s (ray.init, trainer set-up)", "-", f(ray["startup_s"], "{:.1f}")),
          ("CPU-s in the steady state, all processes", f(local["cpu_s"]), f(ray["cpu_s"])),
          ("CPU-ms per trajectory", f(local["cpu_ms_per_traj"]), f(ray["cpu_ms_per_traj"])),
          ("runtime_cpu_s: Ray's own processes and threads", "-", f(ray["runtime_cpu_s"])),
          ("runtime_cpu_share: of all the run's CPU", "-", f(ray["runtime_cpu_share"], "{:.3f}"))]
  if "detect_dead_worker_s" in ray:
    rows += [("detect_dead_worker_s", "-", f(ray["detect_dead_worker_s"])),
             ("detect_hung_worker_s", "-", f(ray["detect_hung_worker_s"]))]
  width = max(len(r[0]) for r in rows)
  lines = [f"{'':{width}}  {'local':>8}  {'ray':>8}"]
  lines += [f"{a:{width}}  {b:>8}  {c:>8}" for a, b, c in rows]
  return "\n".join(lines + [f"CPU measured as: {out['ray']['runtime_cpu_measured']}"])


def median(values):
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", default="runs/bench_cluster.json")
  parser.add_argument("--gin_file", default="configs/text_grpo_tiny.gin")
  parser.add_argument("--train_batches", type=int, default=6)
  parser.add_argument("--warmup", type=int, default=3, help="steps left out of the steady state")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--deadline_s", type=float, default=5.0)
  parser.add_argument("--no_liveness", action="store_true", help="no liveness run")
  args = parser.parse_args()
  if args.warmup < 1:
    parser.error(f"--warmup {args.warmup}: the steady state starts after a step (>= 1)")
  load_at_start = list(os.getloadavg())  # the machine is shared: how busy it was
  tmp = tempfile.mkdtemp(prefix="bench_cluster_")
  # No held-out evaluation: its time is on the loop's path, not the system's throughput.
  bindings = [f"JobConfig.train_batches = {args.train_batches}", "EvalConfig.every_steps = 0"]
  runs = {"local": [], "ray": []}
  try:
    for k in range(args.repeats):
      for name in ("local", "ray"):
        work = os.path.join(tmp, f"{name}{k}")
        summary, records, first, cpu = train(work, args.gin_file,
                                             bindings + (RAY if name == "ray" else []),
                                             cpu_from_step=args.warmup)
        run = dict(traj_per_s=steady(records, args.warmup), first_step_s=first,
                   wall_s=summary["wall_s"], steps=summary["steps"], cpu=cpu)
        if name == "ray":
          run["startup_s"] = summary["ray_wall_s"] - summary["wall_s"]
        runs[name].append(run)
        print(f"{name} run {k}: " + json.dumps({k: v for k, v in run.items() if k != "cpu"}),
              flush=True)
        if cpu:
          print(f"  cpu: {json.dumps(cpu)}", flush=True)
    live = {} if args.no_liveness else liveness(os.path.join(tmp, "liveness"), args.deadline_s)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  med = lambda name, key: median(r[key] for r in runs[name])  # noqa: E731
  cpu = lambda name, key: median((r["cpu"] or {}).get(key) for r in runs[name])  # noqa: E731
  per_traj = lambda name: median(  # noqa: E731
      1e3 * r["cpu"]["total_s"] / r["cpu"]["trajectories"] for r in runs[name] if r["cpu"])
  out = {
      "config": dict(gin_file=args.gin_file, train_batches=args.train_batches,
                     warmup_steps=args.warmup, repeats=args.repeats, cpus=os.cpu_count(),
                     load_average_at_start=load_at_start),
      "local": dict(traj_per_s=med("local", "traj_per_s"),
                    first_step_s=med("local", "first_step_s"), cpu_s=cpu("local", "total_s"),
                    cpu_ms_per_traj=per_traj("local"), runs=runs["local"]),
      "ray": dict(traj_per_s=med("ray", "traj_per_s"), first_step_s=med("ray", "first_step_s"),
                  startup_s=med("ray", "startup_s"), cpu_s=cpu("ray", "total_s"),
                  cpu_ms_per_traj=per_traj("ray"), runtime_cpu_s=cpu("ray", "ray_runtime_s"),
                  runtime_cpu_share=cpu("ray", "ray_runtime_share"),
                  runtime_cpu_measured=CPU_METHOD, runs=runs["ray"], **live),
  }
  out["ray_over_local_traj_per_s"] = out["ray"]["traj_per_s"] / out["local"]["traj_per_s"]
  out["config"]["load_average_at_end"] = list(os.getloadavg())
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=2)
  print(table(out))
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
