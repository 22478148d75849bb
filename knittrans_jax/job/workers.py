"""The rollout side of a local run: pools (job/roles.RolloutPool) that take (group
id, source) requests and return Finished / Failed events.

WorkerPool      `workers` rollout processes on this host (one CPU device each),
                forked from a fork server that imported their modules once
                (`worker_context`). A dead one is restarted: the groups it held that are fully
                committed in its unit count as finished, the rest are reported
                failed (the controller replaces them). A worker that dies
                MAX_COLD_DEATHS times in a row without finishing a group cannot
                start: the run stops with its last error, not after the stall
                timeout of restarts. On Ray the workers are actors
                (cluster/rollout_actors.RayWorkerPool, the same protocol).
ColocatedPool   no workers: `poll` generates the requested groups in this process
                with the trainer's current weights, then reports them (the colocated
                reference, synchronous execution).
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import os
import queue
import time
from typing import Callable

from knittrans_jax.job.roles import Failed, Finished
from knittrans_jax.rollout.worker import GroupDone, GroupFailed, WorkerArgs, WorkerError, worker_main
from knittrans_jax.storage import TrajectoryStore

MAX_COLD_DEATHS = 3  # deaths in a row before a worker's first group: it cannot start

# What a rollout worker imports (rollout/worker.worker_main), imported once by the fork
# server instead of by every worker: a spawned worker spends some 2-3 s of CPU on
# these imports, paid again by its twin and by every restart (docs/results/2026-12-07-tests.md).
_PRELOAD = ["knittrans_jax.rollout.worker", "knittrans_jax.rollout.engines",
            "knittrans_jax.rollout.agent_loop", "knittrans_jax.rollout.groups",
            "knittrans_jax.rollout.weights", "knittrans_jax.models.vlm", "knittrans_jax.storage"]


def worker_context():
  """The start method of local rollout workers: a fork server with the workers' modules
  imported (no JAX backend started there, so forking it is safe). A worker takes this
  process's environment at its start (worker_main's `env`), not the fork server's."""
  ctx = mp.get_context("forkserver")
  ctx.set_forkserver_preload(_PRELOAD)
  return ctx


def prestart() -> None:
  """Starts the fork server now, so that its imports overlap the trainer's set-up."""
  worker_context()
  from multiprocessing import forkserver
  forkserver.ensure_running()


def release(store: TrajectoryStore, held: dict, w: int, n: int, why: str) -> list:
  """A lost worker's groups, taken out of `held` (group id -> (worker, source)): those
  with all n trajectories committed in its unit count as finished, the rest failed."""
  mine = [gid for gid, (ww, _) in held.items() if ww == w]
  committed = collections.defaultdict(list)
  if mine and f"worker{w}" in store.units():
    for m in store.list_committed(f"worker{w}", live=True):  # reclaimed rows: retired
      if m.group_id in held and held[m.group_id][0] == w:
        committed[m.group_id].append(m)
  events = []
  for gid in mine:
    del held[gid]
    events.append(Finished(tuple(committed[gid])) if len(committed[gid]) == n
                  else Failed(gid, why))
  return events


class WorkerPool:
  timed_generation = True  # Finished.seconds: the group's time in its engine (job/controller.py)

  def __init__(self, workdir: str, store_url: str, *, workers: int, worker_args: WorkerArgs,
               store: TrajectoryStore, log: Callable[[str], None] = print):
    self.workdir, self.store, self.store_url = workdir, store, store_url
    self.args, self.log = worker_args, log
    self._ctx = worker_context()
    self.reports, self.stop = self._ctx.Queue(), self._ctx.Event()
    self.procs: dict[int, mp.Process] = {}
    self.requests: dict[int, mp.Queue] = {}
    self.held: dict[int, tuple[int, str]] = {}  # group id -> (worker, source)
    self.restarts = 0
    self.cold_deaths = collections.Counter()  # worker -> deaths since it last finished a group
    self.last_error: dict[int, str] = {}
    for w in range(workers):
      self._start(w)

  def _start(self, w: int) -> None:
    self.requests[w] = self._ctx.Queue()
    p = self._ctx.Process(target=worker_main, daemon=True, args=(
        w, self.workdir, self.store_url, self.args, self.requests[w], self.reports, self.stop),
        kwargs={"env": dict(os.environ)})
    p.start()
    self.procs[w] = p

  def can_take(self) -> bool:
    return bool(self.procs)

  def submit(self, group_id: int, source: str) -> None:
    load = collections.Counter(w for w, _ in self.held.values())
    w = min(self.procs, key=lambda w: (load[w], w))
    self.requests[w].put((group_id, source))
    self.held[group_id] = (w, source)

  def poll(self, timeout: float) -> list:
    events = []
    try:
      msg = self.reports.get(timeout=timeout)
    except queue.Empty:
      msg = None
    while msg is not None:
      events += self._handle(msg)
      try:
        msg = self.reports.get_nowait()
      except queue.Empty:
        msg = None
    for w, p in list(self.procs.items()):
      if not p.is_alive():
        self.cold_deaths[w] += 1
        if self.cold_deaths[w] >= MAX_COLD_DEATHS:
          raise RuntimeError(
              f"rollout worker {w} died {self.cold_deaths[w]} times in a row without finishing "
              f"a group (last exit code {p.exitcode}): it cannot start; its last error:\n"
              f"{self.last_error.get(w, '(none reported)')}")
        self.log(f"\nrollout worker {w} died (exit code {p.exitcode}); restarting it")
        self.restarts += 1
        events += self._release(w)
        self._start(w)
    return events

  def _handle(self, msg: GroupDone | GroupFailed | WorkerError) -> list:
    if isinstance(msg, WorkerError):
      self.log(f"\nrollout worker {msg.worker} failed:\n{msg.message}")
      self.last_error[msg.worker] = msg.message
      return []
    self.cold_deaths[msg.worker] = 0
    if self.held.pop(msg.group_id, None) is None:
      return []  # already released (its worker was lost): reported from the store then
    if isinstance(msg, GroupFailed):
      self.log(f"\nrollout worker {msg.worker}: {msg.reason}; the group is replaced")
      return [Failed(msg.group_id, msg.reason)]
    return [Finished(msg.metas, msg.seconds)]

  def _release(self, w: int) -> list:
    return release(self.store, self.held, w, self.args.n, f"worker {w} was lost")

  def describe(self) -> str:
    load = collections.Counter(w for w, _ in self.held.values())
    workers = [f"worker {w}: {load[w]} groups" for w in sorted({*self.procs, *load})]
    return ", ".join(workers) or "no worker connected"

  def close(self) -> None:
    self.stop.set()
    for q in self.requests.values():
      q.put(None)
    deadline = time.monotonic() + 5.0  # a worker mid-call finishes it; a hung one is killed
    for p in self.procs.values():
      p.join(timeout=max(0.0, deadline - time.monotonic()))
      if p.is_alive():
        p.kill()
        p.join(timeout=5)


class ColocatedPool:
  """Generates requested groups in this process when polled (see module doc).

  `generate(requests)` returns rollout/groups.RolledGroup lists for (group id,
  source) requests, with the current weights; each group is committed to `writer`
  before it is reported."""

  timed_generation = False  # the controller times dispatch-to-done
  restarts = 0  # no workers

  def __init__(self, generate: Callable, writer, chunk: int = 16):
    self.generate, self.writer, self.chunk = generate, writer, chunk
    self.pending: list[tuple[int, str]] = []

  def can_take(self) -> bool:
    return True

  def submit(self, group_id: int, source: str) -> None:
    self.pending.append((group_id, source))

  def poll(self, timeout: float) -> list:
    events = []
    while self.pending:
      requests, self.pending = self.pending[:self.chunk], self.pending[self.chunk:]
      for group in self.generate(requests):
        events.append(Finished(tuple(self.writer.append(group.trajectories, images=group.images))))
    return events

  def describe(self) -> str:
    return f"colocated generation, {len(self.pending)} groups queued"

  def close(self) -> None:
    pass
