"""CPU-seconds of a process tree from /proc, split by process, by thread and, on a Ray
run, into Ray's runtime and ours (scripts/bench_cluster.py). Python threads are told
apart by the registry scripts/thread_names writes (each names its target's module)."""
from __future__ import annotations

import collections
import os
import re

TICK = os.sysconf("SC_CLK_TCK")
CPU_METHOD = ("utime+stime of /proc/PID/stat and /proc/PID/task/TID/stat for every process "
              "and thread under train.py, read at step `warmup` and at the last step; Ray's: "
              "processes other than the driver and the actors of logs/actors.log (GCS, "
              "raylet, dashboard, agents, log monitor, idle workers), and in the driver and "
              "actors the threads Ray started (Python threads by their target's module, "
              "native ones by /proc comm); main threads, unnamed native threads and exited "
              "threads of the driver and actors count as ours")
# Native threads of ours (XLA, LLVM, Eigen) by their /proc comm; any other named native
# thread in the driver or an actor is Ray's core worker (worker.io, client.poll0, ...).
OUR_NATIVE = re.compile(r"tf_|llvm-worker|XLA|xla|pjrt|jax|Eigen|gloo")


def _stat(path: str) -> tuple[str, int, float]:
  """(comm, ppid, CPU-seconds: utime + stime) of a /proc stat file."""
  with open(path) as f:
    text = f.read()
  head, rest = text.rsplit(")", 1)
  fields = rest.split()  # fields[0] is the state (field 3 of proc(5))
  return head.split("(", 1)[1], int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def process_tree(root: int) -> list[int]:
  children = collections.defaultdict(list)
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        children[_stat(f"/proc/{entry}/stat")[1]].append(int(entry))
      except (OSError, ValueError):
        continue  # gone since the listing
  tree, todo = [], [root]
  while todo:
    pid = todo.pop()
    tree.append(pid)
    todo += children.get(pid, [])
  return tree


def process_name(pid: int, root: int) -> str:
  """driver (train.py), a Ray worker's title (its actor's class, idle_worker for a
  worker with none), or the program or script it runs."""
  if pid == root:
    return "driver"
  with open(f"/proc/{pid}/cmdline") as f:
    argv = [a for a in f.read().split("\0") if a]
  if argv and argv[0].startswith("ray::"):  # a Ray worker: its title, ray::Class[.method]
    title = argv[0][5:].split()[0].split(".")[0]
    return "idle_worker" if title == "IDLE" else title
  scripts = [a for a in argv[1:] if a.endswith(".py")]
  name = os.path.basename(scripts[0]) if scripts else os.path.basename(argv[0]) if argv else "?"
  if name in ("main.py", "agent.py"):  # runtime_env/agent/main.py, dashboard/agent.py
    name = os.path.basename(os.path.dirname(scripts[0])) + "/" + name
  return name


def cpu_sample(root: int) -> dict:
  """{(pid, tid): (process name, thread comm, CPU-seconds)} over the tree under root; tid
  0: the process's own total (/proc/PID/stat, which counts its exited threads too)."""
  out = {}
  for pid in process_tree(root):
    try:
      name = process_name(pid, root)
      out[(pid, 0)] = (name, "", _stat(f"/proc/{pid}/stat")[2])
      tids = os.listdir(f"/proc/{pid}/task")
    except (OSError, IndexError, ValueError):
      continue
    for tid in tids:
      try:
        comm, _, cpu = _stat(f"/proc/{pid}/task/{tid}/stat")
      except (OSError, ValueError):
        continue
      out[(pid, int(tid))] = (name, comm, cpu)
  return out


def thread_registry(log_dir: str) -> dict:
  """{(pid, tid): (thread name, target's module, starter's module)} from thread_names."""
  out = {}
  for fname in os.listdir(log_dir):
    with open(os.path.join(log_dir, fname)) as f:
      for line in f:
        parts = line.rstrip("\n").split("\t")
        if len(parts) == 4:
          out[(int(fname.split(".")[0]), int(parts[0]))] = tuple(parts[1:])
  return out


def our_actors(workdir: str) -> set[int]:
  """The pids of the run's actors, as each wrote them on starting (ray_setup.record_start:
  logs/actors.log, 'ROLE PID ADDRESS' a line): Ray's own agents have Ray titles too."""
  try:
    with open(os.path.join(workdir, "logs", "actors.log")) as f:
      return {int(line.split()[1]) for line in f if line.strip()}
  except FileNotFoundError:
    return set()


def ray_thread_owner(pid: int, tid: int, comm: str, ours: set[int], registry: dict) -> str:
  """'ray' or 'ours' for one thread of a Ray run; ours: the driver's and actors' pids."""
  if pid not in ours:
    return "ray"  # a daemon (gcs_server, raylet, dashboard, agents), an idle worker
  if tid == pid:
    return "ours"  # the driver's loop, a sync actor's methods (Ray's calls into them too)
  if (pid, tid) in registry:
    _, module, starter = registry[(pid, tid)]
    return "ray" if module.startswith("ray") or starter.startswith("ray") else "ours"
  if OUR_NATIVE.match(comm) or comm.startswith(("python", "ray::")):
    return "ours"  # XLA's, or unnamed (its owner unknown: counted as ours)
  return "ray"


def cpu_split(start: dict, end: dict, registry: dict, ours: set[int] | None) -> dict:
  """CPU-seconds between two cpu_samples: in all, by process, by thread (the 12 most),
  and on a Ray run (`ours`: the driver's and the actors' pids) Ray's runtime by process
  and by thread. Threads that exited in
  between are a process's total less its live threads ('(exited threads)', owner
  unknown: ours in the driver and actors); a process gone by `end` is not counted
  (`processes_gone`)."""
  total, by_process, by_thread = 0.0, collections.Counter(), collections.Counter()
  ray_by_process, ray_threads = collections.Counter(), collections.Counter()
  exited = collections.Counter()
  for (pid, tid), (process, comm, cpu) in end.items():
    seconds = cpu - start.get((pid, tid), (None, None, 0.0))[2]
    if process == "?":  # its cmdline read empty (being retitled): the name it had before
      process = start.get((pid, 0), (process,))[0]
    if tid == 0:
      total += seconds
      by_process[process] += seconds
      exited[(pid, process)] += seconds
      continue
    exited[(pid, process)] -= seconds
    if (pid, tid) in registry:  # a Python thread: its name and its target's module
      thread = "{} [{}]".format(*registry[(pid, tid)][:2])
    else:
      thread = "main" if pid == tid else comm
    by_thread[f"{process}/{thread}"] += seconds
    if ours is not None and ray_thread_owner(pid, tid, comm, ours, registry) == "ray":
      ray_by_process[process] += seconds
      ray_threads[f"{process}/{thread}"] += seconds
  for (pid, process), seconds in exited.items():
    by_thread[f"{process}/(exited threads)"] += seconds
    if ours is not None and pid not in ours:
      ray_by_process[process] += seconds
      ray_threads[f"{process}/(exited threads)"] += seconds
  r = lambda c: {k: round(v, 2) for k, v in c.most_common(12) if v >= 0.005}  # noqa: E731
  out = dict(total_s=total, by_process=r(by_process), by_thread=r(by_thread),
             processes_gone=sum(1 for (pid, tid) in start if tid == 0 and (pid, 0) not in end))
  if ours is not None:
    runtime = sum(ray_by_process.values())
    out.update(ray_runtime_s=runtime, ray_runtime_share=runtime / total if total else None,
               ray_runtime_by_process=r(ray_by_process), ray_runtime_by_thread=r(ray_threads))
  return out
