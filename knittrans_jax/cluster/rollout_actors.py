"""Rollout workers as Ray actors, and the pool the controller dispatches to.

`RolloutActor` runs the same worker loop as a local worker process
(rollout/worker.worker_main) on a thread of an async actor; `generate(group_id,
source)` returns once the group is committed to the actor's storage unit, with its
metadata only: payloads never pass through Ray.

`RayWorkerPool` has the controller's pool interface (job/workers.WorkerPool's):
`submit` starts one call per group, `poll` collects finished calls. Liveness comes
from Ray and from deadlines, not a heartbeat:
- a dead actor (crash, SIGKILL, its node lost) fails its calls; Ray restarts it
  (RayConfig.worker_restarts) under the same id and unit;
- a call past its deadline (the dispatch's own estimate of the source's group time,
  RayConfig.call_deadline_*) means the worker hangs: it is killed and restarted.
Either way the groups it held that are fully committed in its unit count as
finished and the rest go back to dispatch (Failed), as for a local worker.
"""
from __future__ import annotations

import asyncio
import collections
import os
import queue
import sys
import threading
import time
from typing import Callable

from knittrans_jax.cluster.ray_setup import RayConfig, actor_env, record_start
from knittrans_jax.job.roles import Failed, Finished
from knittrans_jax.job.workers import release
from knittrans_jax.rollout.worker import (GroupDone, GroupFailed, WorkerArgs, WorkerError,
                                          one_device_xla_flags, worker_main)


def _node_address() -> str:
  import ray
  return ray.util.get_node_ip_address()  # the unit's host: hostnames may all be alike


class RolloutActor:
  """One rollout worker (see module doc); `worker_id` names its storage unit."""

  def __init__(self, worker_id: int, workdir: str, store_url: str, args: WorkerArgs):
    os.environ["XLA_FLAGS"] = one_device_xla_flags(os.environ.get("XLA_FLAGS", ""))  # before JAX
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    self.id, self.loop = worker_id, None
    self.requests, self.stop = queue.Queue(), threading.Event()
    self.pending: dict[int, asyncio.Future] = {}
    record_start(workdir, f"rollout{worker_id}")
    self.thread = threading.Thread(target=self._run, daemon=True, args=(
        worker_id, workdir, store_url, args, self.requests, self, self.stop, _node_address()))
    self.thread.start()

  def _run(self, *args, **kwargs) -> None:
    try:
      worker_main(*args, **kwargs)
    except BaseException:  # noqa: BLE001  (printed by worker_main's report; the actor dies)
      sys.stderr.flush()
      time.sleep(0.2)
      os._exit(1)  # Ray sees the actor die and restarts it; its calls fail

  # worker_main's report queue: called on the engine thread.
  def put(self, msg: GroupDone | GroupFailed | WorkerError) -> None:
    if isinstance(msg, WorkerError):
      print(f"rollout actor {self.id} failed:\n{msg.message}", file=sys.stderr, flush=True)
      return
    self.loop.call_soon_threadsafe(self._resolve, msg.group_id, msg)

  def _resolve(self, gid: int, result) -> None:
    fut = self.pending.pop(gid, None)
    if fut is not None and not fut.done():
      fut.set_result(result)

  async def generate(self, group_id: int, source: str):
    """The worker's GroupDone once the group is committed, or its GroupFailed
    (rollout/worker.py)."""
    self.loop = asyncio.get_running_loop()
    fut = self.loop.create_future()
    self.pending[group_id] = fut
    self.requests.put((group_id, source))
    return await fut

  def pid(self) -> int:
    return os.getpid()

  def close(self) -> None:
    self.stop.set()
    self.requests.put(None)
    self.thread.join(timeout=5)


class RayWorkerPool:
  timed_generation = True  # Finished.seconds: the group's time in its engine

  def __init__(self, workdir: str, store, store_url: str, *, workers: int, worker_args: WorkerArgs,
               cfg: RayConfig, estimate: Callable[[str], float | None] = lambda s: None,
               log: Callable[[str], None] = print):
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    self.ray, self.store, self.cfg, self.log = ray, store, cfg, log
    self.args, self.estimate = worker_args, estimate
    self.n, self.per_call = worker_args.n, worker_args.groups_per_call
    self.pg = placement_group([dict(cfg.rollout_resources)] * workers,
                              strategy=cfg.rollout_strategy, name="")
    try:
      ray.get(self.pg.ready(), timeout=cfg.startup_timeout_s)
    except ray.exceptions.GetTimeoutError:
      ray.util.remove_placement_group(self.pg)
      raise RuntimeError(f"{workers} rollout actors of {cfg.rollout_resources} "
                         f"({cfg.rollout_strategy}) could not be placed in "
                         f"{cfg.startup_timeout_s:g} s; the cluster has "
                         f"{ray.available_resources()}") from None
    cls = ray.remote(RolloutActor)
    bundle = dict(cfg.rollout_resources)
    self.actors = {}
    for w in range(workers):
      self.actors[w] = cls.options(
          max_restarts=cfg.worker_restarts, max_task_retries=0, num_cpus=bundle.get("CPU", 0),
          resources={k: v for k, v in bundle.items() if k != "CPU"},
          scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, w),
          runtime_env={"env_vars": {**actor_env(cfg), "XLA_FLAGS": one_device_xla_flags(
              os.environ.get("XLA_FLAGS", ""))}},
      ).remote(w, workdir, store_url, worker_args)
    self.calls: dict = {}  # ref -> (group id, worker, deadline)
    self.held: dict[int, tuple[int, str]] = {}  # group id -> (worker, source)
    self.started = {w: time.monotonic() for w in self.actors}  # a (re)start's first group
    self.warm: set[int] = set()  # workers that have finished a group since they (re)started
    self.deaths = collections.Counter()
    self.recovering: dict[int, object] = {}  # worker -> a ping to its restarted actor
    self.restarts = 0

  def _alive(self) -> list[int]:
    """Workers that can take groups: not dead for good, not being restarted."""
    return [w for w in self.actors
            if self.deaths[w] <= self.cfg.worker_restarts and w not in self.recovering]

  def can_take(self) -> bool:
    return bool(self._alive())

  def submit(self, group_id: int, source: str) -> None:
    load = collections.Counter(w for w, _ in self.held.values())
    w = min(self._alive(), key=lambda w: (load[w], w))
    ref = self.actors[w].generate.remote(group_id, source)
    self.calls[ref] = (group_id, w, self._deadline(w, source, load[w]))
    self.held[group_id] = (w, source)

  def _deadline(self, w: int, source: str, ahead: int) -> float:
    """Before a worker's first group (start-up, compilation) the start-up allowance;
    then the dispatch's estimate for the source, scaled by the queue ahead."""
    now, cfg = time.monotonic(), self.cfg
    if w not in self.warm:
      return max(now, self.started[w]) + cfg.startup_timeout_s
    est = self.estimate(source) or 0.0
    return now + cfg.call_deadline_s + cfg.call_deadline_factor * est * (ahead // self.per_call + 1)

  def poll(self, timeout: float) -> list:
    ray = self.ray
    events = []
    if self.calls:
      ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=timeout)
      if ready:
        ready, _ = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
      lost = []
      for ref in ready:
        if ref not in self.calls:
          continue  # its worker was released by an earlier ref of this batch
        gid, w, _ = self.calls.pop(ref)
        try:
          done: GroupDone | GroupFailed = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
          lost.append((w, f"died ({type(e).__name__})"))
          continue
        except ray.exceptions.RayTaskError as e:
          lost.append((w, f"failed: {e}"))
          continue
        self.warm.add(w)
        if self.held.get(gid, (None,))[0] == w:
          del self.held[gid]
          if isinstance(done, GroupFailed):
            self.log(f"\nrollout actor {w}: {done.reason}; the group is replaced")
            events.append(Failed(gid, done.reason))
          else:
            events.append(Finished(done.metas, done.seconds))
      now, hung = time.monotonic(), {}
      for gid, w, deadline in self.calls.values():
        if now > deadline and w not in hung:
          hung[w] = f"hung: group {gid} is past its deadline"
      for w, why in hung.items():
        self.ray.kill(self.actors[w], no_restart=False)  # Ray restarts it
        lost.append((w, why))
      for w, why in lost:
        if any(cw == w for _, cw, _ in self.calls.values()) or any(
            hw == w for hw, _ in self.held.values()):
          events += self._lose(w, why)
    elif timeout:
      time.sleep(timeout)
    self._check_recovering()
    if not self._alive() and not self.recovering:
      raise RuntimeError(f"every rollout actor died more than RayConfig.worker_restarts = "
                         f"{self.cfg.worker_restarts} times")
    return events

  def _lose(self, w: int, why: str) -> list:
    """Worker w is gone (Ray restarts it): forget its calls, release its groups."""
    self.deaths[w] += 1
    self.restarts += 1
    left = self.cfg.worker_restarts - self.deaths[w] + 1
    self.log(f"\nrollout actor {w} {why}; re-dispatching what it held"
             + (f" ({left} restarts left)" if left > 0 else " (no restarts left)"))
    for ref in [r for r, (_, cw, _) in self.calls.items() if cw == w]:
      del self.calls[ref]
    self.warm.discard(w)
    self.started[w] = time.monotonic()
    if self.deaths[w] <= self.cfg.worker_restarts:
      self.recovering[w] = self.actors[w].pid.remote()
    return release(self.store, self.held, w, self.n, f"rollout actor {w} was lost")

  def _check_recovering(self) -> None:
    """A restarted actor takes groups again once it answers; calls made while Ray
    restarts it would fail at once (ActorUnavailableError) and count as deaths."""
    ray = self.ray
    for w, ref in list(self.recovering.items()):
      if not ray.wait([ref], timeout=0)[0]:
        if time.monotonic() - self.started[w] > self.cfg.startup_timeout_s:
          self.log(f"\nrollout actor {w} did not come back within RayConfig.startup_timeout_s "
                   f"= {self.cfg.startup_timeout_s:g} s (no node can hold it?); going on without it")
          self.deaths[w] = self.cfg.worker_restarts + 1
          del self.recovering[w]
        continue
      try:
        ray.get(ref)
      except ray.exceptions.ActorUnavailableError:  # still restarting: ask again
        self.recovering[w] = self.actors[w].pid.remote()
        continue
      except ray.exceptions.RayActorError:  # dead for good (its restarts are spent)
        self.deaths[w] = self.cfg.worker_restarts + 1
      del self.recovering[w]
      self.started[w] = time.monotonic()

  def describe(self) -> str:
    load = collections.Counter(w for w, _ in self.held.values())
    return ", ".join(f"rollout actor {w}: {load[w]} groups" for w in sorted(self.actors))

  def close(self) -> None:
    ray = self.ray
    done = [a.close.remote() for a in self.actors.values()]
    try:
      ray.wait(done, num_returns=len(done), timeout=5)
    finally:
      for a in self.actors.values():
        ray.kill(a, no_restart=True)
      ray.util.remove_placement_group(self.pg)
