"""Discrete-event model of one RL job: rollout fleet, weight sync, trainer, admission.

The admission policy is the real one (knittrans_jax.admission), driven through its
public interface: dispatched / finished / admit / short_sources.

Time only moves at events: a response finishing, the trainer finishing a
mini-batch, a new version becoming visible to the engines (only with
interrupt_on_sync). A response that starts at t decodes with the newest version
published by t - sync_latency_s; its v_gen is that version. A group's version for
the staleness bound is the oldest of its responses.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq

import numpy as np

from knittrans_jax.admission import GroupInfo, make_policy
from knittrans_jax.admission.dispatch import make_dispatch
from knittrans_jax.sim.config import SimConfig
from knittrans_jax.sim.workload import LengthSampler

_RESP, _TRAIN, _SYNC = 0, 1, 2


class SimulationStalled(RuntimeError):
  """The policy can never admit again at this window (e.g. train_batch with W < G)."""


@dataclasses.dataclass
class SimResult:
  """Per-trajectory records of the trained trajectories, plus run totals."""
  mode: str
  policy: str
  window: int
  dispatch: str
  v_gen: np.ndarray
  v_consume: np.ndarray
  j: np.ndarray
  train_batch: np.ndarray
  source: np.ndarray  # index into `sources`
  group_id: np.ndarray
  sources: tuple[str, ...]
  sim_time_s: float
  trainer_busy_s: float
  slot_busy_s: float
  slots: int
  mini_batch_counts: list[tuple[int, int, dict]]  # (k, j, {source: groups})
  dropped: dict[str, int]
  mean_in_system: float  # time-average of groups dispatched but not trained or dropped
  mean_sojourn_s: float  # dispatch to trained (or dropped), per group
  groups_done: int
  rollout_versions: np.ndarray  # per finished group: versions elapsed while it decoded
  rollout_s: np.ndarray  # per finished group: dispatch to last response done
  v_done: np.ndarray  # per trajectory: the version when its group finished decoding
  max_in_window: int = 0  # most groups ever dispatched but not trained or dropped
  step_end_s: np.ndarray | None = None  # per optimizer step: when it finished
  # Per dispatched group, by id: its source (index into `sources`), dispatch to last
  # response done in seconds (nan: still decoding at the end) and its fate ('trained',
  # a drop reason, or 'pending': finished or in flight when the run ended).
  group_source: np.ndarray | None = None
  group_gen_s: np.ndarray | None = None
  group_fate: tuple[str, ...] = ()
  options: dict | None = None  # the admission policy's knobs (a peer rule's)

  @property
  def arch(self) -> np.ndarray:
    """Architectural staleness a = v_consume - v_gen - j per trajectory."""
    return self.v_consume - self.v_gen - self.j

  @property
  def arch_floor(self) -> np.ndarray:
    """max(v_done - v_gen - j, 0) per trajectory: the architectural staleness left if
    every group trained the moment it finished decoding, at its j. v_consume >=
    v_done, so no admission policy gets below it at this dispatch and throughput."""
    return np.maximum(self.v_done - self.v_gen - self.j, 0)

  @property
  def trajectories(self) -> int:
    return int(self.v_gen.size)


def simulate(config: SimConfig, policy: str = "constraint_preserving", window: int | None = None,
             mode: str = "disaggregated", dispatch: str = "shuffled",
             dispatch_kwargs: dict | None = None, options: dict | None = None) -> SimResult:
  """Runs `config.train_batches` train batches; deterministic for `config.seed`.
  `dispatch` picks the order groups start in (admission/dispatch.py); `options` are
  the admission policy's knobs (a peer rule's, admission/peers.py). A rule that gates
  starts (`may_start`) is asked before each dispatch, inside the window."""
  if mode not in ("disaggregated", "colocated"):
    raise ValueError(f"mode = {mode!r}: use 'disaggregated' or 'colocated'")
  spec = config.spec
  n, G, M = spec.group_size, spec.groups_per_batch, spec.num_mini_batches
  colocated = mode == "colocated"
  if colocated:
    policy, window = "train_batch", G  # rollout of a whole batch, then train it
  window = window if window is not None else 2 * G
  if window < spec.mini_batch_groups:
    raise ValueError(f"window W = {window} < g = {spec.mini_batch_groups}: no mini-batch can form")
  latency = 0.0 if colocated else config.sync_latency_s
  rng = np.random.default_rng(config.seed)
  dispatch_name = dispatch  # `dispatch` is the refill function below
  stream = make_dispatch(dispatch_name, spec, config.sources, rng, **(dispatch_kwargs or {}))
  pol = make_policy(policy, spec, **(options or {}))
  interrupt = (config.interrupt_on_sync or pol.interrupts_in_flight) and not colocated
  names = tuple(config.sources)
  src_index = {s: i for i, s in enumerate(names)}
  tpt = config.time_per_token_s

  # Group tables (grown as groups are dispatched).
  g_source, g_dur, g_vstart, g_left, g_dispatch, g_tokens = [], [], [], [], [], []
  g_vdone = {}  # group id -> version when its last response finished
  g_fate, g_gen = {}, {}  # group id -> 'trained' or a drop reason; -> seconds to finish
  lengths = LengthSampler(config, rng)
  # Trace mode draws recorded times from its own stream: the model mode's draws stay as
  # they were.
  trace_rng = np.random.default_rng([config.seed, 104729])
  traced = config.group_seconds is not None
  events: list = []
  seq = 0
  queue: collections.deque = collections.deque()  # requests waiting for a slot
  replace: collections.deque = collections.deque()  # sources of dropped groups
  free = config.slots
  published = [(0.0, 0)]  # (time, version)
  visible_ptr = 0
  version = 0
  now = 0.0
  in_window = 0
  max_in_window = 0
  area = 0.0  # integral of in_window over time
  sojourn_sum, groups_done = 0.0, 0
  dispatched_net = 0  # dispatched minus dropped
  target_groups = config.train_batches * G
  target_steps = config.train_batches * M
  steps = 0
  trainer_busy, trainer_busy_s, slot_busy_s = False, 0.0, 0.0
  dropped = collections.Counter()
  req_end, req_gen, req_start = {}, {}, {}  # in-flight requests by (gid, r)
  train_start = 0.0
  rec = collections.defaultdict(list)
  mb_counts = []
  rollout_versions, rollout_s = [], []
  step_end = []
  current_mb = None

  def push(t, kind, payload):
    nonlocal seq
    heapq.heappush(events, (t, seq, kind, payload))
    seq += 1

  def visible_version(t):
    nonlocal visible_ptr
    while visible_ptr + 1 < len(published) and published[visible_ptr + 1][0] + latency <= t:
      visible_ptr += 1
    return published[visible_ptr][1]

  def start_requests():
    nonlocal free
    v = visible_version(now)
    while free and queue:
      gid, r = queue.popleft()
      free -= 1
      g_vstart[gid][r] = v
      pre, dur = g_dur[gid][r]
      end = now + pre + dur  # summed in the order the model mode always has
      req_end[(gid, r)], req_gen[(gid, r)], req_start[(gid, r)] = end, 0, now
      push(end, _RESP, (gid, r, 0))

  def dispatch_one(source):
    nonlocal in_window, dispatched_net
    gid = len(g_source)
    g_source.append(source)
    lens = lengths.take(source, n)
    src = config.sources[source]
    if traced:  # the whole group takes one recorded time
      times = config.group_seconds[source]
      g_dur.append([(0.0, times[trace_rng.integers(len(times))])] * n)
    else:
      g_dur.append([(src.prefill_s, x * tpt) for x in lens])
    g_tokens.append(sum(lens) + n * src.prompt_tokens)
    g_vstart.append([0] * n)
    g_left.append(n)
    g_dispatch.append(now)
    pol.dispatched(source, group_id=gid)
    in_window += 1
    dispatched_net += 1
    queue.extend((gid, r) for r in range(n))

  def dispatch():
    nonlocal max_in_window
    if colocated:
      if in_window == 0 and dispatched_net < target_groups:
        for _ in range(G):
          dispatch_one(stream.next())
    else:
      while in_window < window and dispatched_net < target_groups and pol.may_start(version):
        # The stream keeps every block of G at the quota mix; a dropped group is
        # replaced by one of its source first (what short_sources() asks for).
        dispatch_one(replace.popleft() if replace else stream.next())
    max_in_window = max(max_in_window, in_window)
    start_requests()

  def account_drops(drops):
    nonlocal in_window, dispatched_net, sojourn_sum, groups_done
    for grp, why in drops:
      dropped[why] += 1
      g_fate[grp.group_id] = why
      replace.append(grp.source)
      in_window -= 1
      dispatched_net -= 1
      sojourn_sum += now - g_dispatch[grp.group_id]
      groups_done += 1

  def try_train():
    nonlocal trainer_busy, current_mb, train_start
    if trainer_busy or steps >= target_steps:
      return
    mb = pol.admit(version)
    account_drops(pol.take_dropped())
    if mb is None:
      return
    trainer_busy, current_mb, train_start = True, mb, now
    tokens = 0
    for grp in mb.groups:
      gid = grp.group_id
      tokens += g_tokens[gid]
      rec["v_gen"] += g_vstart[gid]
      rec["v_consume"] += [version] * n
      rec["j"] += [mb.index] * n
      rec["k"] += [mb.train_batch] * n
      rec["source"] += [src_index[grp.source]] * n
      rec["group"] += [gid] * n
      rec["v_done"] += [g_vdone[gid]] * n
    mb_counts.append((mb.train_batch, mb.index, collections.Counter(grp.source for grp in mb.groups)))
    if config.train_step_seconds is not None:
      steps_s = config.train_step_seconds
      took = steps_s[trace_rng.integers(len(steps_s))]
    else:
      took = config.trainer_fixed_s + config.trainer_per_token_s * tokens
    push(now + took, _TRAIN, None)

  dispatch()
  while events and steps < target_steps:
    t, _, kind, payload = heapq.heappop(events)
    area += in_window * (t - now)
    now = t
    if kind == _RESP:
      gid, r, gen = payload
      if gen != req_gen.get((gid, r)):
        continue  # superseded by an interrupt
      started = req_start.pop((gid, r))
      del req_gen[(gid, r)], req_end[(gid, r)]
      free += 1
      slot_busy_s += now - started
      g_left[gid] -= 1
      start_requests()
      if g_left[gid] == 0:
        src = g_source[gid]
        v_first = min(g_vstart[gid])
        rollout_versions.append(version - v_first)
        rollout_s.append(now - g_dispatch[gid])
        g_gen[gid] = now - g_dispatch[gid]
        g_vdone[gid] = version
        stream.observe(src, now - g_dispatch[gid])
        account_drops(pol.finished(GroupInfo(gid, src, g_tokens[gid], v_first)))
        try_train()
        dispatch()  # refills the window if admission dropped stale groups
    elif kind == _TRAIN:
      mb = current_mb
      trainer_busy_s += now - train_start
      trainer_busy = False
      version += 1
      steps += 1
      step_end.append(now)
      # A rule may sync weights every few steps (verl's trigger_parameter_sync_step).
      if (config.publish == "step" and steps % pol.publish_every == 0) or (
          config.publish == "train_batch" and mb.index == M - 1):
        published.append((now, version))
        if interrupt:
          push(now + latency, _SYNC, None)
      for grp in mb.groups:
        g_fate[grp.group_id] = "trained"
        sojourn_sum += now - g_dispatch[grp.group_id]
        groups_done += 1
      in_window -= len(mb.groups)
      try_train()  # may drop stale groups: dispatch after it sees the window
      dispatch()
    else:  # _SYNC: in-flight requests switch weights and pay the interrupt cost
      for key, end in list(req_end.items()):
        req_gen[key] += 1
        req_end[key] = end + config.interrupt_cost_s
        push(req_end[key], _RESP, (*key, req_gen[key]))
      start_requests()
  if steps < target_steps:
    raise SimulationStalled(f"simulation stalled after {steps} of {target_steps} optimizer steps "
                       f"(policy {policy}, W = {window}); short sources: {pol.short_sources()}")
  as_array = lambda key: np.asarray(rec[key], np.int64)
  return SimResult(
      mode=mode, policy=policy, window=window, dispatch=dispatch_name, v_gen=as_array("v_gen"),
      v_consume=as_array("v_consume"), j=as_array("j"), train_batch=as_array("k"),
      source=as_array("source"), group_id=as_array("group"), sources=names, sim_time_s=now,
      trainer_busy_s=trainer_busy_s, slot_busy_s=slot_busy_s, slots=config.slots,
      mini_batch_counts=mb_counts, dropped=dict(dropped), mean_in_system=area / now,
      mean_sojourn_s=sojourn_sum / max(groups_done, 1), groups_done=groups_done,
      rollout_versions=np.asarray(rollout_versions), rollout_s=np.asarray(rollout_s),
      v_done=as_array("v_done"), max_in_window=max_in_window,
      step_end_s=np.asarray(step_end),
      group_source=np.asarray([src_index[s] for s in g_source], np.int64),
      group_gen_s=np.asarray([g_gen.get(i, np.nan) for i in range(len(g_source))]),
      group_fate=tuple(g_fate.get(i, "pending") for i in range(len(g_source))),
      options=pol.options())
