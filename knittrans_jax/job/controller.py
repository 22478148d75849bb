"""The controller role: dispatch, admission and progress, over metadata only.

    controller = Controller(spec, policy, dispatch, pool, ControllerState(), window=W)
    controller.resume(store)                    # a restored run: feed what was not trained
    while ...:
      controller.dispatch(version)              # fill the window (replacements first)
      controller.poll(timeout)                  # rollout reports -> admission
      mb = controller.admit(version)            # a mini-batch, or None
      ...                                       # the trainer steps on it
      controller.trained(mb)                    # retire its groups; position moves on
      controller.check_stall()                  # raises JobStalled after a long idle

Every group goes through `ControllerState` (progress.py): dispatched into the
window, then retired exactly once as trained, dropped (zero signal or stale) or
failed; a dropped or failed group is replaced by one of its source, first in
line. The window is derived from those ids, so resume, drops, stale groups and
the synchronous schedule all keep it right by construction.

The rollout side is a `RolloutPool` (job/roles.py): local worker processes, Ray
actors, or the colocated generator. It takes (group id, source) requests and its
`poll` returns `Finished(metas)` and `Failed(group_id)` events. With
`synchronous=True` (modes 'colocated' and 'synchronous') a whole train batch is
dispatched only once the previous one is trained (plus replacements at any time),
so every group of train batch k is generated with the weights of version k*M, as
synchronous execution does.

Pure Python; no JAX.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Sequence

from knittrans_jax.admission import AdmissionPolicy, TrainBatchSpec
from knittrans_jax.admission.costs import tail_bias
from knittrans_jax.admission.dispatch import DispatchStream
from knittrans_jax.job.config import STALL_TIMEOUT_S
from knittrans_jax.job.progress import ControllerState
from knittrans_jax.job.roles import Failed, Finished, RolloutPool
from knittrans_jax.types import GroupInfo, MiniBatch, TrajMeta


class JobStalled(RuntimeError):
  """Nothing was admitted and no usable group finished for too long."""


class Controller:

  def __init__(self, spec: TrainBatchSpec, policy: AdmissionPolicy, dispatch: DispatchStream,
               pool: RolloutPool, state: ControllerState, *, window: int,
               synchronous: bool = False, stall_timeout_s: float = STALL_TIMEOUT_S,
               clock: Callable[[], float] = time.monotonic):
    self.spec, self.policy, self.pool, self.state = spec, policy, pool, state
    self.dispatch_order = dispatch  # the order prompt sources start in (admission/dispatch.py)
    self.window, self.synchronous = window, synchronous
    self.stall_timeout_s, self.clock = stall_timeout_s, clock
    # Sources owed a replacement (dropped or failed groups); saved with the state.
    self.replace: collections.deque[str] = collections.deque(state.replace)
    self._positions: dict[tuple[int, int], dict] = {}  # admitted, not yet trained
    self._last_progress = clock()
    self._version = 0  # the trainer's version as last seen (admit, dispatch)
    self._sent_at: dict[int, float] = {}  # group id -> when it was dispatched (this process)
    # Each finished group's source, dispatch and report times (seconds from here) and
    # the pool's generation time: what the simulator's trace mode replays (sim/trace.py).
    self._t0 = clock()
    self.group_times: list[dict] = []
    # Each retired group's fate ('trained' or why it was dropped or failed), this
    # process: with group_times, the run's tail bias (admission/costs.py).
    self.fates: dict[int, str] = {}
    if state.stream is not None:
      dispatch.restore(state.stream)
    if state.position is not None:
      policy.restore_position(state.position)

  # ---- resume -------------------------------------------------------------------
  def resume(self, units: Sequence[str], list_unit: Callable[[str, int], list[TrajMeta]]) -> int:
    """Feeds the window's committed groups (and, disaggregated, any committed after
    the checkpoint) back to admission; window groups that never committed count as
    failed and are replaced. Lists each unit from its watermark. Returns the groups
    fed. Synchronous, groups committed after the checkpoint are skipped (their ids
    too): train batch k+1 is generated again from the restored weights, so it is
    the batch an uninterrupted run would have, and no surplus group keeps the window
    from emptying."""
    st, n = self.state, self.spec.group_size
    found: dict[int, list[TrajMeta]] = collections.defaultdict(list)
    for unit in units:
      metas = list_unit(unit, st.start_rows.get(unit, 0))
      st.saw(metas)
      for m in metas:
        found[m.group_id].append(m)
    fed = 0
    for gid in sorted(found):
      metas = sorted(found[gid], key=lambda m: m.index_in_group)
      if len(metas) != n:
        continue  # a group commits all n rows at once; a partial one is not a group
      if gid >= st.next_group:
        if self.synchronous:
          st.skip_to(gid + 1)
          continue
        st.adopt(gid, metas[0].source)  # dispatched after the checkpoint
      elif gid not in st.window:
        continue  # retired before the checkpoint
      self.policy.dispatched(metas[0].source, group_id=gid)
      self._finished(metas)
      fed += 1
    for gid in [g for g in st.window if not st.is_finished(g)]:
      self.replace.append(st.retire(gid, "failed"))  # its worker is gone with the old run
    return fed

  # ---- dispatch -------------------------------------------------------------------
  def dispatch(self, version: int | None = None) -> int:
    """Sends groups to rollout while the window has room and the policy lets one
    start (a peer rule's gate, admission/peers.py, at the trainer's `version`; default
    the last one seen); returns how many."""
    if version is not None:
      self._version = version
    sent = 0
    if self.synchronous:
      if not self.state.window and not self.replace:  # the last train batch is trained
        for _ in range(self.spec.groups_per_batch):
          self._send(self.dispatch_order.next())
          sent += 1
      while self.replace:
        self._send(self.replace.popleft())
        sent += 1
      return sent
    while (len(self.state.window) < self.window and self.pool.can_take()
           and self.policy.may_start(self._version)):
      self._send(self.replace.popleft() if self.replace else self.dispatch_order.next())
      sent += 1
    return sent

  def _send(self, source: str) -> None:
    gid = self.state.dispatch(source)
    self.policy.dispatched(source, group_id=gid)
    self._sent_at[gid] = self.clock()
    self.pool.submit(gid, source)

  # ---- reports ------------------------------------------------------------------
  def poll(self, timeout: float = 0.0) -> int:
    """Takes the pool's events (waiting up to `timeout` for the first); returns how many."""
    events = self.pool.poll(timeout)
    st = self.state
    for ev in events:
      if isinstance(ev, Finished):
        st.saw(ev.metas)
        gid = ev.metas[0].group_id
        # A late or repeated report (a worker released, then heard from) changes nothing.
        if gid in st.window and not st.is_finished(gid):
          self._finished(sorted(ev.metas, key=lambda m: m.index_in_group), ev.seconds)
      elif isinstance(ev, Failed):
        if ev.group_id in st.window and not st.is_finished(ev.group_id):
          source = self.state.retire(ev.group_id, "failed")
          self.fates[ev.group_id] = "failed"
          self.policy.failed(source, group_id=ev.group_id)
          self.replace.append(source)
      else:
        raise TypeError(f"unknown rollout event {ev!r}")
    return len(events)

  def _finished(self, metas: list[TrajMeta], seconds: float | None = None) -> None:
    self.state.finished(metas)
    sent = self._sent_at.pop(metas[0].group_id, None)
    # Completion times teach dispatch: the group's generation time where the pool
    # measures it (`timed_generation`; None then means not this group: its call also
    # compiled); dispatch-to-done otherwise. The first excludes the wait in a
    # worker's queue, which the dispatch order itself sets (a source started first
    # waits less and would look faster than it is).
    now = self.clock()
    self.group_times.append({"group": metas[0].group_id, "source": metas[0].source,
                             "sent": None if sent is None else sent - self._t0,
                             "done": now - self._t0, "seconds": seconds})
    if seconds is None and sent is not None and not self.pool.timed_generation:
      seconds = now - sent
    if seconds is not None:
      self.dispatch_order.observe(metas[0].source, seconds)
    dropped = self.policy.finished(GroupInfo.from_metas(metas))
    if not dropped:
      self._last_progress = self.clock()
    self._retire(dropped)

  def _retire(self, dropped) -> None:
    for grp, why in dropped:
      self.replace.append(self.state.retire(grp.group_id, why))
      self.fates[grp.group_id] = why

  # ---- admission and training -----------------------------------------------------
  def admit(self, version: int) -> MiniBatch | None:
    self._version = version
    mb = self.policy.admit(version)
    self._retire(self.policy.take_dropped())  # stale groups are dropped inside admit
    if mb is not None:
      self._positions[(mb.train_batch, mb.index)] = self.policy.position()
      self._last_progress = self.clock()
    return mb

  def trained(self, mb: MiniBatch) -> None:
    """The mini-batch's step is done: its groups retire, the position moves past it."""
    for grp in mb.groups:
      self.state.retire(grp.group_id, "trained")
      self.fates[grp.group_id] = "trained"
    self.state.position = self._positions.pop((mb.train_batch, mb.index))
    self._last_progress = self.clock()

  def progress(self) -> dict:
    """The durable state for a checkpoint (as of the last trained mini-batch)."""
    self.state.stream = self.dispatch_order.state()
    self.state.replace = list(self.replace)
    return self.state.to_json()

  def tail_bias(self) -> dict:
    """costs.tail_bias over the groups that finished in this process: time from
    dispatch to report, and each one's fate ('pending' if not retired yet)."""
    return tail_bias((g["source"], None if g["sent"] is None else g["done"] - g["sent"],
                      self.fates.get(g["group"], "pending")) for g in self.group_times)

  # ---- stalls ---------------------------------------------------------------------
  def check_stall(self) -> None:
    idle = self.clock() - self._last_progress
    if idle > self.stall_timeout_s:
      raise JobStalled(self.describe(idle))

  def describe(self, idle: float | None = None) -> str:
    p, st = self.policy, self.state
    head = (f"no mini-batch admitted and no usable group finished for {idle:.0f} s "
            f"(JobConfig.stall_timeout_s = {self.stall_timeout_s:g}); " if idle is not None else "")
    return (f"{head}train batch {p.train_batch} mini-batch {p.index}: still needs "
            f"{p.needed() if p.needed() is not None else 'any source'}; short sources "
            f"{p.short_sources() or 'none'}; in flight {st.in_flight() or 'none'} "
            f"({len(st.window)} of window {self.window}); finished, not admitted "
            f"{p.pool_counts() or 'none'}; retired {dict(st.retired) or 'none'}; rollout: "
            f"{self.pool.describe()}")
