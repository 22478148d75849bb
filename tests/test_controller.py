"""The controller over metadata only (job/controller.py, job/progress.py): a fake
rollout pool and a fake trainer, the job's loop in miniature. Covers the defects of
issue 15: resume after drops, colocated drops, stalls, and the admission position
of a mini-batch admitted but not trained."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from knittrans_jax.admission import TrainBatchSpec, make_policy
from knittrans_jax.job.controller import Controller, JobStalled
from knittrans_jax.job.roles import Failed, Finished
from knittrans_jax.job.progress import ControllerState, ProgressError
from knittrans_jax.admission.dispatch import Shuffled
from knittrans_jax.types import TrajMeta

SOURCES = ("a", "b", "c")
N = 2


def spec(**kw):
  base = dict(group_size=N, groups_per_batch=6, num_mini_batches=3,
              source_quota={"a": 2, "b": 2, "c": 2})
  return TrainBatchSpec(**{**base, **kw})


class FakePool:
  """Finishes up to `per_poll` queued groups per poll into two units; group rewards
  from `reward(gid)` (equal rewards: zero signal); version from `version()`."""
  timed_generation, restarts = False, 0

  def __init__(self, reward=lambda gid: [0.0, 1.0], per_poll=2, version=lambda: 0):
    self.queue: list[tuple[int, str]] = []
    self.rows = {"w0": [], "w1": []}
    self.reward, self.per_poll, self.version = reward, per_poll, version
    self.lost: list[int] = []  # group ids to report failed instead

  def can_take(self):
    return True

  def submit(self, gid, source):
    self.queue.append((gid, source))

  def poll(self, timeout):
    events = []
    for gid, source in self.queue[:self.per_poll]:
      if gid in self.lost:
        events.append(Failed(gid, "lost"))
        continue
      unit = f"w{gid % 2}"
      rows = self.rows[unit]
      metas = tuple(TrajMeta(unit, len(rows) + i, 0, 2, 3, source, gid, i, self.version(),
                             self.version(), r) for i, r in enumerate(self.reward(gid)))
      rows.extend(metas)
      events.append(Finished(metas))
    del self.queue[:self.per_poll]
    return events

  def describe(self):
    return f"{len(self.queue)} queued"

  def list_unit(self, unit, start):
    return list(self.rows[unit][start:])


class Run:
  """The job's loop without JAX: one mini-batch admitted ahead of the step."""

  def __init__(self, sp, pool, state=None, policy="constraint_preserving", window=None,
               synchronous=False, clock=None, version=0):
    self.spec, self.pool, self.version = sp, pool, version
    self.policy = make_policy(policy, sp)
    self.ctl = Controller(sp, self.policy, Shuffled(sp, SOURCES, np.random.default_rng(0)),
                          pool, state or ControllerState(),
                          window=window or 2 * sp.groups_per_batch, synchronous=synchronous,
                          stall_timeout_s=10.0, **({"clock": clock} if clock else {}))
    pool.version = lambda: self.version
    self.trained = []  # (version, mini-batch)
    self.checkpoints = []  # (version, progress json)

  def loop(self, target, max_iters=10_000, checkpoint_every=None):
    ahead = collections.deque()

    def admit():
      if not ahead and (mb := self.ctl.admit(self.version)) is not None:
        ahead.append(mb)
    for _ in range(max_iters):
      if self.version >= target:
        return
      self.ctl.dispatch()
      self.ctl.poll()
      admit()
      if not ahead:
        self.ctl.check_stall()
        continue
      mb = ahead.popleft()
      self.version += 1  # the step
      self.ctl.dispatch()
      self.ctl.poll()
      admit()  # read ahead: admitted, not trained
      self.ctl.trained(mb)
      self.trained.append((self.version, mb))
      if checkpoint_every and self.version % checkpoint_every == 0:
        self.checkpoints.append((self.version, json.loads(json.dumps(self.ctl.progress()))))
    raise AssertionError(f"no progress after {max_iters} iterations: {self.ctl.describe()}")


def gids(trained):
  return [grp.group_id for _, mb in trained for grp in mb.groups]


def check_batches(trained, sp):
  """Every train batch: M mini-batches j = 0..M-1, in order, exact quotas."""
  by_k = collections.defaultdict(list)
  for _, mb in trained:
    by_k[mb.train_batch].append(mb)
  for k, mbs in by_k.items():
    assert [mb.index for mb in mbs] == list(range(len(mbs))), (k, [mb.index for mb in mbs])
    if len(mbs) == sp.num_mini_batches:
      counts = collections.Counter(grp.source for mb in mbs for grp in mb.groups)
      assert counts == collections.Counter(sp.source_quota), (k, counts)


def test_state_retires_once_and_round_trips():
  st = ControllerState()
  a, b = st.dispatch("x"), st.dispatch("y")
  st.finished([TrajMeta("u", 5, 0, 1, 1, "x", a, 0, 0, 0, 1.0)])
  assert st.watermarks() == {"u": 5} and st.in_flight() == {"y": 1}
  assert st.retire(a, "trained") == "x"
  assert st.watermarks() == {"u": 6}
  with pytest.raises(ProgressError, match="already retired"):
    st.retire(a, "stale")
  with pytest.raises(ProgressError, match="never dispatched"):
    st.retire(7, "failed")
  back = ControllerState.from_json(json.loads(json.dumps(st.to_json())))
  assert back.next_group == 2 and back.window == {b: "y"} and back.start_rows == {"u": 6}
  with pytest.raises(ProgressError, match="older version"):
    ControllerState.from_json({"consumed": ["u/0"], "next_group": 3})


def test_window_is_derived_and_replacements_go_first():
  sp = spec()
  pool = FakePool(per_poll=0)
  run = Run(sp, pool, window=5)
  assert run.ctl.dispatch() == 5 and len(run.ctl.state.window) == 5
  assert run.ctl.dispatch() == 0
  pool.lost, pool.per_poll = [0], 1
  run.ctl.poll()  # group 0's worker was lost: failed, replaced by its source first
  assert run.ctl.state.retired == {"failed": 1} and len(run.ctl.state.window) == 4
  lost_source = run.ctl.replace[0]
  run.ctl.dispatch()
  assert pool.queue[-1] == (5, lost_source) and len(run.ctl.state.window) == 5


@pytest.mark.parametrize("policy", ["constraint_preserving", "train_batch"])
def test_resume_after_zero_signal_and_stale_drops_finishes(policy):
  """The issue's reproduction in miniature: drops before a checkpoint, a crash after
  it, resume; before the fix the window filled with ghosts and nothing dispatched."""
  sp = spec(drop_zero_signal=True, max_staleness=2)
  zero = lambda gid: [1.0, 1.0] if gid % 5 == 0 else [0.0, 1.0]  # noqa: E731
  first = Run(sp, FakePool(reward=zero, per_poll=3), policy=policy)
  first.loop(target=10, checkpoint_every=4)
  dropped = first.ctl.state.retired["zero_signal"] + first.ctl.state.retired["stale"]
  assert first.ctl.state.retired["zero_signal"] > 0 and first.ctl.state.retired["stale"] > 0
  v, progress = first.checkpoints[-1]  # the crash: steps after the checkpoint are undone
  before = [(ver, mb) for ver, mb in first.trained if ver <= v]
  state = ControllerState.from_json(progress)
  second = Run(sp, first.pool, state=state, policy=policy, version=v)
  fed = second.ctl.resume(list(first.pool.rows), first.pool.list_unit)
  assert fed > 0
  second.loop(target=24)
  trained = gids(before) + gids(second.trained)
  assert len(trained) == len(set(trained)), "a group trained twice"
  zero_gids = {g for g in range(second.ctl.state.next_group) if g % 5 == 0}
  assert not set(trained) & zero_gids, "a zero-signal group trained"
  check_batches(before + second.trained, sp)
  assert dropped >= 1 and len(second.ctl.state.window) <= 2 * sp.groups_per_batch


def test_stale_drop_is_retired_once_across_resume():
  sp = spec(max_staleness=0)
  run = Run(sp, FakePool(per_poll=6))
  run.loop(target=6, checkpoint_every=3)
  stale_before = run.ctl.state.retired["stale"]
  assert stale_before > 0
  v, progress = run.checkpoints[0]
  state = ControllerState.from_json(progress)
  again = Run(sp, run.pool, state=state, version=v)
  again.ctl.resume(list(run.pool.rows), run.pool.list_unit)
  # Groups dropped before the checkpoint are retired in it: never fed again.
  fed_ids = {g for g in again.ctl.state.window if again.ctl.state.is_finished(g)}
  assert not fed_ids & {g for g in range(progress["next_group"])
                        if str(g) not in progress["window"]}


def test_resume_keeps_the_train_batch_index_of_a_mini_batch_admitted_ahead():
  """A mini-batch admitted (read ahead) but not trained when the run stops is admitted
  again on resume with the same j; the train batch gets all M mini-batches."""
  sp = spec()
  run = Run(sp, FakePool(per_poll=4))
  run.loop(target=4, checkpoint_every=1)
  v, progress = run.checkpoints[-1]
  M = sp.num_mini_batches
  assert (progress["position"]["train_batch"], progress["position"]["index"]) == (v // M, v % M)
  assert run.ctl._positions, "the loop admitted one ahead"
  again = Run(sp, run.pool, state=ControllerState.from_json(progress), version=v)
  again.ctl.resume(list(run.pool.rows), run.pool.list_unit)
  again.loop(target=9)
  check_batches(run.trained + again.trained, sp)
  assert [mb.index for _, mb in again.trained][:2] == [v % 3, (v + 1) % 3]
  trained = gids(run.trained) + gids(again.trained)
  assert len(trained) == len(set(trained))


def test_groups_committed_after_the_checkpoint_are_adopted_and_lost_ones_replaced():
  sp = spec()
  run = Run(sp, FakePool(per_poll=3))
  run.loop(target=3, checkpoint_every=3)
  v, progress = run.checkpoints[-1]
  run.loop(target=5)  # after the checkpoint: more groups committed, then the crash
  committed = {m.group_id for rows in run.pool.rows.values() for m in rows}
  state = ControllerState.from_json(progress)
  again = Run(sp, run.pool, state=state, version=v)
  again.ctl.resume(list(run.pool.rows), run.pool.list_unit)
  window = set(again.ctl.state.window)
  assert max(committed) in window  # adopted
  assert again.ctl.state.next_group == max(committed) + 1
  never = {int(g) for g in progress["window"]} - committed
  assert again.ctl.state.retired["failed"] == len(never)
  assert len(again.ctl.replace) == len(never)


def test_colocated_replaces_dropped_groups_and_finishes():
  sp = spec(drop_zero_signal=True)
  zero = lambda gid: [1.0, 1.0] if gid % 4 == 1 else [0.0, 1.0]  # noqa: E731
  run = Run(sp, FakePool(reward=zero, per_poll=100), policy="train_batch", synchronous=True)
  run.loop(target=9, max_iters=200)
  check_batches(run.trained, sp)
  assert run.ctl.state.retired["zero_signal"] > 0
  # Each train batch was generated at its first mini-batch's version (synchronous).
  for ver, mb in run.trained:
    assert all(grp.version == (ver - 1) - mb.index for grp in mb.groups), (ver, mb.index)


def test_stall_names_the_short_sources_and_what_is_in_flight():
  now = [0.0]
  sp = spec()
  pool = FakePool(per_poll=0)  # a hung worker: nothing ever finishes
  run = Run(sp, pool, clock=lambda: now[0])
  run.ctl.dispatch()
  run.ctl.check_stall()
  now[0] = 10.5
  with pytest.raises(JobStalled, match=r"for 10 s \(JobConfig.stall_timeout_s = 10\).*short "
                                       r"sources none; in flight \{.*\} \(12 of window 12\)"):
    run.ctl.check_stall()
  # No worker to take anything: every source with a quota is short.
  pool = FakePool()
  pool.can_take = lambda: False
  run = Run(sp, pool, clock=lambda: now[0])
  assert run.ctl.dispatch() == 0
  now[0] = 30.0
  with pytest.raises(JobStalled, match=r"short sources \['a', 'b', 'c'\]; in flight none"):
    run.ctl.check_stall()


def test_a_source_whose_groups_are_all_dropped_stalls_instead_of_spinning():
  now = [0.0]

  def clock():
    now[0] += 0.01
    return now[0]
  sp = spec(drop_zero_signal=True)
  pool = FakePool(reward=lambda gid: [1.0, 1.0], per_poll=4)
  run = Run(sp, pool, clock=clock)
  with pytest.raises(JobStalled, match="zero_signal"):
    run.loop(target=3, max_iters=5000)


def test_repeated_or_late_reports_change_nothing():
  sp = spec()
  pool = FakePool(per_poll=0)
  run = Run(sp, pool)
  run.ctl.dispatch()
  pool.per_poll = 1
  run.ctl.poll()  # group 0 finished
  done = Finished(tuple(pool.rows["w0"]))
  pool.poll = lambda timeout: [done, Failed(0, "worker lost after committing")]
  run.ctl.poll()  # the same report again, then a failure for a finished group
  assert run.ctl.state.is_finished(0) and not run.ctl.state.retired
  assert run.policy.pool_counts() == {pool.rows['w0'][0].source: 1}  # group 0, fed once
  pool.poll = lambda timeout: [Failed(1, "lost"), Failed(1, "lost again")]
  run.ctl.poll()
  assert run.ctl.state.retired == {"failed": 1} and len(run.ctl.replace) == 1
  late = Finished(tuple(TrajMeta("w1", i, 0, 2, 3, "a", 1, i, 0, 0, float(i)) for i in range(N)))
  pool.poll = lambda timeout: [late]  # the lost worker reports after all
  run.ctl.poll()
  assert not run.ctl.state.is_finished(1) and run.ctl.state.retired == {"failed": 1}


def test_replacements_owed_at_a_checkpoint_are_kept():
  sp = spec(drop_zero_signal=True)
  pool = FakePool(reward=lambda gid: [1.0, 1.0] if gid in (0, 1) else [0.0, 1.0], per_poll=0)
  run = Run(sp, pool)
  run.ctl.dispatch()
  pool.per_poll = 2
  run.ctl.poll()  # groups 0 and 1 dropped: two replacements owed, not yet dispatched
  progress = json.loads(json.dumps(run.ctl.progress()))
  assert progress["replace"] == list(run.ctl.replace) and len(progress["replace"]) == 2
  again = Run(sp, pool, state=ControllerState.from_json(progress))
  assert list(again.ctl.replace) == progress["replace"]


def test_colocated_resume_regenerates_the_batch_begun_after_the_checkpoint():
  """Colocated, a crash after train batch k+1 was generated (a dropped group and its
  replacement committed too): on resume those groups are skipped and k+1 is
  generated again, so the window empties and every later batch is dispatched."""
  sp = spec(drop_zero_signal=True)
  zero = lambda gid: [1.0, 1.0] if gid % 7 == 3 else [0.0, 1.0]  # noqa: E731
  run = Run(sp, FakePool(reward=zero, per_poll=100), policy="train_batch", synchronous=True)
  run.loop(target=3, checkpoint_every=3)
  v, progress = run.checkpoints[-1]
  run.loop(target=4)  # batch 1 generated (with a drop and its replacement), one step
  committed = max(m.group_id for rows in run.pool.rows.values() for m in rows)
  again = Run(sp, run.pool, state=ControllerState.from_json(progress), policy="train_batch",
              synchronous=True, version=v)
  assert again.ctl.resume(list(run.pool.rows), run.pool.list_unit) == 0
  assert again.ctl.state.next_group == committed + 1 and not again.ctl.state.window
  again.loop(target=9, max_iters=300)
  check_batches(run.trained[:3] + again.trained, sp)
  for ver, mb in again.trained:
    assert all(grp.group_id > committed for grp in mb.groups)
    assert all(grp.version == (ver - 1) - mb.index for grp in mb.groups)


def test_dispatch_learns_the_generation_time_a_pool_reports():
  """A group's generation time, when the pool measures it, is what the dispatch
  policy learns; otherwise its dispatch-to-done time on the controller's clock."""
  seen = []

  class Recording(Shuffled):
    def observe(self, source, seconds):
      seen.append((source, seconds))

  class TimedPool(FakePool):
    def poll(self, timeout):
      return [Finished(ev.metas, 0.25 if ev.metas[0].group_id % 2 else None)
              if isinstance(ev, Finished) else ev for ev in super().poll(timeout)]

  now = [0.0]
  sp = spec()
  ctl = Controller(sp, make_policy("constraint_preserving", sp),
                   Recording(sp, SOURCES, np.random.default_rng(0)), TimedPool(),
                   ControllerState(), window=4, clock=lambda: now[0])
  ctl.dispatch()
  now[0] = 3.0
  ctl.poll()
  assert [s for _, s in seen] == [3.0, 0.25]  # group 0: measured here; group 1: reported
  # A pool that times generation reports None for a call that compiled: not learned.
  seen.clear()
  ctl.pool.timed_generation = True
  ctl.dispatch()
  ctl.poll()
  assert [s for _, s in seen] == [0.25]
