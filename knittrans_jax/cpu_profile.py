"""Where a run's CPU time goes, by phase, in every process (`scripts/train.py --profile`).

Off unless the environment names a directory (KNITTRANS_PROFILE=DIR, which a run's
worker processes inherit): then each process that calls `start(role)` writes
DIR/<role>-<pid>.json when it ends and `summarize(DIR)` adds them up. Off, `phase()`
is a no-op context manager and nothing else runs.

CPU seconds, not wall (on a shared machine wall time hides who paid), attributed so
that every second the process used lands in exactly one place:
  - `startup`: the process's CPU until `loop_started()`, which a role calls once its
    first unit of work is done (the trainer's first step, a worker's first group), so
    imports, building, restoring and the first compilations are in it; a shape
    compiled later is in the phase that met it;
  - a phase: the CPU of the Python thread inside `with phase(name)` (time.thread_time),
    on any thread (the trainer's prefetch thread reads in `store_read`);
  - the process's `compute_phase` (a worker's `engine`, the trainer's `train_step`):
    the CPU of its threads that are not Python's (XLA's compute pools, PjRt's),
    because JAX dispatches asynchronously and a computation overlaps whatever
    Python does next;
  - `other`: what live Python threads used outside any phase (metrics, progress
    bar, checkpoints, queues' feeder threads); a Python thread that ended before the
    profile is written counts its CPU outside phases as computation.
"""
from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import threading
import time

ENV = "KNITTRANS_PROFILE"
# The phases, in report order; a role uses the ones it has.
PHASES = ("startup", "engine", "store_write", "controller", "store_read", "train_step",
          "publish", "other")

_state = None


class _State:

  def __init__(self, directory: str, role: str, compute_phase: str):
    self.directory, self.role, self.compute_phase = directory, role, compute_phase
    self.cpu = collections.defaultdict(float)
    self.phased = collections.defaultdict(float)  # thread id -> its CPU inside phases
    self.startup_cpu = None  # process CPU at loop_started()
    self.threads_at_start: dict[int, float] = {}  # thread id -> CPU at loop_started()
    self.t0 = time.perf_counter()
    self.lock = threading.Lock()
    self.pid = os.getpid()


def enabled() -> bool:
  return _state is not None and _state.pid == os.getpid()


def start(role: str, compute_phase: str) -> None:
  """Profiles this process if KNITTRANS_PROFILE names a directory; `compute_phase`
  gets the CPU of the threads that are not Python's."""
  global _state
  directory = os.environ.get(ENV)
  if not directory or enabled():
    return  # off, or already started (a forked child starts its own)
  if compute_phase not in PHASES:
    raise ValueError(f"compute_phase {compute_phase!r}: use one of {PHASES}")
  os.makedirs(directory, exist_ok=True)
  _state = _State(directory, role, compute_phase)


def _process_cpu() -> float:
  t = os.times()
  return t.user + t.system


def loop_started() -> None:
  """The role's first unit of work is done: its CPU so far is start-up (once)."""
  if enabled() and _state.startup_cpu is None:
    _state.threads_at_start = _threads_cpu()
    _state.startup_cpu = _process_cpu()


@contextlib.contextmanager
def phase(name: str):
  """This thread's CPU inside the block goes to `name` (once the loop has started)."""
  if not enabled() or _state.startup_cpu is None:
    yield
    return
  c0 = time.thread_time()
  try:
    yield
  finally:
    spent = time.thread_time() - c0
    with _state.lock:
      _state.cpu[name] += spent
      _state.phased[threading.get_native_id()] += spent


def _threads_cpu() -> dict[int, float]:
  """{thread id: CPU seconds} of this process's live threads, from /proc."""
  tick = os.sysconf("SC_CLK_TCK")
  out = {}
  for stat in glob.glob("/proc/self/task/*/stat"):
    try:
      with open(stat) as f:
        text = f.read()
    except OSError:  # the thread ended
      continue
    fields = text[text.rindex(")") + 2:].split()
    out[int(stat.split("/")[-2])] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
  return out


def snapshot() -> dict:
  """This process's profile so far: {role, pid, wall_s, cpu_s: {phase: s}, total_cpu_s}."""
  s = _state
  total = _process_cpu()
  out = {"role": s.role, "pid": os.getpid(), "wall_s": time.perf_counter() - s.t0,
         "total_cpu_s": total}
  if s.startup_cpu is None:  # never finished a unit of work: all of it was start-up
    return {**out, "cpu_s": {"startup": total}}
  with s.lock:
    cpu, phased = dict(s.cpu), dict(s.phased)
  now = _threads_cpu()
  python = {t.native_id for t in threading.enumerate()} & now.keys()
  cpu["startup"] = s.startup_cpu
  # Live Python threads' CPU outside phases (/proc counts in ticks: clipped at 0).
  cpu["other"] = sum(max(0.0, now[t] - s.threads_at_start.get(t, 0.0) - phased.get(t, 0.0))
                     for t in python)
  # The rest (threads that are not Python's, and ones that ended) computed.
  cpu[s.compute_phase] = cpu.get(s.compute_phase, 0.0) + max(0.0, total - sum(cpu.values()))
  return {**out, "cpu_s": cpu}


def write() -> None:
  if not enabled():
    return
  path = os.path.join(_state.directory, f"{_state.role}-{os.getpid()}.json")
  with open(path, "w") as f:
    json.dump(snapshot(), f)

def summarize(directory: str, trajectories: int, wall_s: float, cores: int) -> dict:
  """The run's profile: CPU ms per trajectory by phase, summed over its processes, and
  `idle`: the cores' time over the run's wall that no process used."""
  files = sorted(glob.glob(os.path.join(directory, "*.json")))
  if not files:
    raise FileNotFoundError(f"{directory}: no process profiles (was {ENV} set for the run?)")
  if trajectories <= 0:
    raise ValueError(f"trajectories = {trajectories}: a profile is per trajectory")
  total = collections.defaultdict(float)
  roles = collections.defaultdict(lambda: collections.defaultdict(float))
  for path in files:
    with open(path) as f:
      p = json.load(f)
    for ph, s in p["cpu_s"].items():
      total[ph] += s
      roles[p["role"]][ph] += s
  used = sum(total.values())
  per = {ph: 1e3 * total.get(ph, 0.0) / trajectories for ph in PHASES}
  per["idle"] = 1e3 * max(0.0, cores * wall_s - used) / trajectories
  return {"ms_per_trajectory": per, "cpu_s": dict(total), "wall_s": wall_s, "cores": cores,
          "trajectories": trajectories, "processes": len(files),
          "by_role": {r: dict(v) for r, v in roles.items()}}


def table(report: dict) -> str:
  """The profile as a few lines: CPU ms per trajectory by phase."""
  per = report["ms_per_trajectory"]
  lines = [f"CPU ms per trajectory ({report['trajectories']} trajectories, "
           f"{report['processes']} processes, {report['cores']} cores, "
           f"{report['wall_s']:.1f} s wall):"]
  total = sum(per.values())
  for ph in (*PHASES, "idle"):
    lines.append(f"  {ph:<12} {per[ph]:8.3f}  {100 * per[ph] / total:5.1f}%")
  return "\n".join(lines)
