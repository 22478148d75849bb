"""The admission rules peers ship, beside ours on the same interface (issue 60).

Each rule is read from the peer's own code (the snapshot named in its docstring)
and mapped onto this project's terms the same way for every rule:
  - a peer's batch of prompt groups for one version is one of our mini-batches of
    g = G / M groups, and a peer's policy version is one of ours (an optimizer
    step): every rule then streams at the granularity ours does, which is the
    freshest reading of each peer (AReaL with ppo_n_minibatches = M would admit a
    whole train batch at once);
  - a peer's sample is one of our groups (each peer counts prompt groups);
  - weights reach the engines after every optimizer step, as for every rule here;
  - the caller's window W is the peer's concurrency cap (AReaL's
    max_concurrent_rollouts, NeMo-RL's max_inflight_prompts); a rule's own gate
    (`may_start`) binds inside it;
  - none keeps quotas: the train batch (k, j) numbering is ours, used to measure
    how far each rule's mix strays from them (admission/costs.py).
A rule that drops groups reports them as ours do ('stale'); the caller replaces
each with one of its source, as peers requeue or resample. A spec's own
max_staleness still applies to every rule (it is the user's requirement).

  areal            AReaL: start while accepted + running < (eta + v + 1) g; the g
                   oldest-started finished groups
  verl             verl fully async: a staleness counter reset at each parameter
                   sync; the first finished groups, require_batches x g at a time;
                   partial_rollout continues requests in flight on new weights
  nemo_weight_fifo NeMo-RL WeightFifoSampler: start gate as AReaL's (gate window =
                   max_staleness_versions); oldest start weight first; evicts groups
                   older than the bound
  nemo_windowed    NeMo-RL WindowedSampler: no start gate; any fresh-enough group in
                   buffer (dispatch) order, or freshest first; evicts older ones
  prime_rl         prime-rl: sources drawn by ratio (dispatch 'ratio', quotas in
                   expectation); no start gate; first finished first; drops groups
                   more than max_off_policy_steps behind
  tinker_discard   tinker-cookbook's async rule before PR #822: first finished
                   first; a group more than max_steps_off_policy behind is discarded
                   and its prompt rolled out again (the rule the PR replaces because
                   it biases training toward fast problems)

Pure Python over metadata; no JAX.
"""
from __future__ import annotations

import collections

import gin

from knittrans_jax.admission.policies import AdmissionPolicy
from knittrans_jax.admission.spec import TrainBatchSpec
from knittrans_jax.types import GroupInfo


def _int_at_least(owner: str, field: str, value, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(f"{owner}.{field} = {value!r} must be an int >= {low}")
  return value


class _PeerRule(AdmissionPolicy):
  """What the peer rules share: no quota tracking, a finish-order pool view."""

  knobs: tuple[tuple[str, str], ...] = ()  # (knob, attribute) pairs options() reports

  def _fresh_needs(self):
    return None  # peers keep no quotas; costs.py measures how far they stray

  def options(self):
    return {k: getattr(self, attr) for k, attr in self.knobs}

  def restore_position(self, position):
    """A resumed run: the groups trained before count as started (AReaL's
    `on_version_recovered` sets accepted = version x batch size), so a gate on what
    was ever started holds across the restart."""
    super().restore_position(position)
    self._started += self._version_seen * self.g

  def _finished_groups(self) -> list[GroupInfo]:
    return [grp for v in self._pool.values() for grp in v]

  def _by_arrival(self, groups: list[GroupInfo]) -> list[GroupInfo]:
    return sorted(groups, key=lambda grp: self._order[grp.group_id][1])

  def _live(self) -> int:
    """Groups started and not rejected (failed or dropped): AReaL's accepted + running."""
    return self._started - self._failed - len(self.dropped)

  def _drop_older_than(self, version: int, bound: int) -> None:
    """Drops finished groups whose start version is more than `bound` behind."""
    for grp in [grp for grp in self._finished_groups() if version - grp.version > bound]:
      self._drop(grp, "stale")


@gin.configurable
class ArealPolicy(_PeerRule):
  """AReaL (inclusionAI/AReaL @4aef98d): `StalenessManager.get_capacity` in
  areal/infra/staleness_manager.py gates starts,
      capacity = min(max_concurrent_rollouts - running,
                     (max_head_offpolicyness + version + 1) * consumer_batch_size
                     - (accepted + running)),
  accepted counting every accepted rollout ever (consumed ones too), a rejected one
  freeing its place. `WorkflowExecutor.wait_results` takes the `count` oldest-started
  finished results (sorted by their submission time) and drops none.
  Adapted: consumer_batch_size = g; max_concurrent_rollouts is the caller's window;
  the start order is the group id (ids are given in dispatch order); AReaL's shuffle
  of the batch is left out (a mini-batch is a set here).
  """
  name = "areal"
  knobs = (("max_head_offpolicyness", "eta"),)

  def __init__(self, spec: TrainBatchSpec, max_head_offpolicyness: int = 2):
    super().__init__(spec)
    self.eta = _int_at_least("ArealPolicy", "max_head_offpolicyness", max_head_offpolicyness, 0)

  def _gate(self, version):
    return self._live() < (self.eta + version + 1) * self.g

  def _next(self, version):
    done = self._finished_groups()
    if len(done) < self.g:
      return None
    return sorted(done, key=lambda grp: grp.group_id)[:self.g]


@gin.configurable
class VerlPolicy(_PeerRule):
  """verl fully async (volcengine/verl @b178a3c, verl/experimental/fully_async_policy/):
  `FullyAsyncRollouter.set_max_required_samples`:
      required = ppo_mini_batch_size * require_batches
      max_required = int(required * (staleness_threshold + 1) * trigger_parameter_sync_step)
  Each new prompt started adds 1 to a staleness counter; each parameter sync
  (`update_param_version`) resets it to what is in the pipeline (running, cancelled
  and queued); generation pauses while the counter or the queue reaches
  max_required. The trainer pops the message queue first in, first out, `required`
  samples a local step; a sync follows every trigger_parameter_sync_step local steps.
  With partial_rollout, requests in flight at a sync are aborted and continued on the
  new weights (their first version kept); without, the sync waits for them.
  Adapted: ppo_mini_batch_size = g (a local step is require_batches optimizer steps);
  weights reach rollout only at those syncs (`publish_every`, honoured by the
  simulator and the job); partial_rollout maps onto `interrupts_in_flight` (the
  simulator's interrupt_on_sync, at each sync; the job's engines take new weights
  between calls, vLLM's in-flight mode 'reprefill' within them); without it requests
  in flight finish on their weights but the sync does not wait for them (verl's
  drain is not modelled, which can only make verl look faster here).
  """
  name = "verl"
  knobs = (("staleness_threshold", "staleness_threshold"),
           ("trigger_parameter_sync_step", "trigger"), ("require_batches", "require"),
           ("partial_rollout", "interrupts_in_flight"))

  def __init__(self, spec: TrainBatchSpec, staleness_threshold: float = 0.1,
               trigger_parameter_sync_step: int = 4, require_batches: int = 1,
               partial_rollout: bool = True):
    super().__init__(spec)
    if isinstance(staleness_threshold, bool) or not isinstance(
        staleness_threshold, (int, float)) or not staleness_threshold >= 0:
      raise ValueError(f"VerlPolicy.staleness_threshold = {staleness_threshold!r} must be a "
                       "number >= 0")
    self.trigger = _int_at_least("VerlPolicy", "trigger_parameter_sync_step",
                                 trigger_parameter_sync_step, 1)
    self.require = _int_at_least("VerlPolicy", "require_batches", require_batches, 1)
    if not isinstance(partial_rollout, bool):
      raise ValueError(f"VerlPolicy.partial_rollout = {partial_rollout!r} must be a bool")
    self.staleness_threshold = float(staleness_threshold)
    self.interrupts_in_flight = partial_rollout
    self.max_required = int(self.g * self.require * (1 + self.staleness_threshold) * self.trigger)
    self.publish_every = self.trigger * self.require  # a sync every trigger local steps
    self._counter = 0  # verl's staleness_samples
    self._syncs = 0  # parameter syncs seen
    self._queued: collections.deque[list[GroupInfo]] = collections.deque()

  def _observe(self, version: int) -> None:
    syncs = version // (self.trigger * self.require)
    if syncs > self._syncs:  # a sync: the counter restarts from what is in the pipeline
      self._syncs = syncs
      self._counter = sum(self._inflight.values()) + sum(self.pool_counts().values())

  def dispatched(self, source, count=1, group_id=None):
    super().dispatched(source, count, group_id)
    self._counter += count

  def _gate(self, version):
    self._observe(version)
    queue = sum(self.pool_counts().values())
    return self._counter < self.max_required and queue < self.max_required

  def _next(self, version):
    self._observe(version)
    if not self._queued:
      done = self._by_arrival(self._finished_groups())
      need = self.require * self.g
      if len(done) < need:
        return None
      self._queued.extend(done[i:i + self.g] for i in range(0, need, self.g))
    return self._queued.popleft()

  def _drop_stale(self, version):
    if not self._queued:  # a local step's mini-batches are trained as taken
      super()._drop_stale(version)


class _NemoSampler(_PeerRule):
  """NeMo-RL's samplers stamp each slot with the weight version at dispatch
  (`start_weight`, set when the slot is reserved); both select and evict by it. Here
  the stamp is the trainer's version when the group was dispatched (the caller names
  each group's id; a group dispatched unnamed falls back to its first token's version)."""

  def _stamp(self, grp: GroupInfo) -> int:
    return self._dispatched_at.get(grp.group_id, grp.version)

  def _evict(self, version: int) -> int:
    """Drops ready groups stamped before w - bound; returns that floor, min_valid."""
    min_valid = max(0, version - self.bound)
    for grp in [grp for grp in self._finished_groups() if self._stamp(grp) < min_valid]:
      self._drop(grp, "stale")
    return min_valid


@gin.configurable
class NemoWeightFifoPolicy(_NemoSampler):
  """NeMo-RL's WeightFifoSampler (NVIDIA-NeMo/RL @7ea279ab,
  nemo_rl/algorithms/async_utils/staleness_sampler.py): `admit` blocks dispatch
  while the dispatch index >= trainer version + gate_window (gate_window =
  max_staleness_versions: gate_window + 1 steps' groups in flight); `select` finds the
  oldest start weight among all slots, ready or in flight, in
  [w - max_staleness_versions, w] and takes only ready slots of that weight; `evict`
  drops ready slots stamped before that window.
  Adapted: groups_per_step = g; a mini-batch is formed once g groups can be taken in
  that order (NeMo-RL's pump selects again until the step has its groups): the ready
  groups of the oldest weight, then, only if no group of that weight is still in
  flight, of the next weight.
  """
  name = "nemo_weight_fifo"
  knobs = (("max_staleness_versions", "bound"),)

  def __init__(self, spec: TrainBatchSpec, max_staleness_versions: int = 1):
    super().__init__(spec)
    self.bound = _int_at_least("NemoWeightFifoPolicy", "max_staleness_versions",
                               max_staleness_versions, 0)

  def _gate(self, version):
    # NeMo-RL's dispatch index only grows: an evicted group's place is not given back.
    return self._started < (self.bound + version + 1) * self.g

  def _next(self, version):
    min_valid = self._evict(version)
    ready = collections.defaultdict(list)
    for grp in self._finished_groups():
      ready[self._stamp(grp)].append(grp)
    # In flight: dispatched, not finished (a finished group is in the pool's order).
    flying = {v for gid, v in self._dispatched_at.items()
              if v >= min_valid and gid not in self._order}
    chosen: list[GroupInfo] = []
    for weight in sorted(set(ready) | flying):
      chosen += sorted(ready.get(weight, ()), key=lambda grp: grp.group_id)[:self.g - len(chosen)]
      if len(chosen) == self.g:
        return chosen
      if weight in flying:
        return None  # NeMo-RL waits for the oldest weight's groups still in flight
    return None


@gin.configurable
class NemoWindowedPolicy(_NemoSampler):
  """NeMo-RL's WindowedSampler (the file NemoWeightFifoPolicy names): no dispatch
  gate (the buffer and max_inflight_prompts bound it); `select` takes ready slots
  stamped in [w - max_staleness_versions, w], in buffer order or freshest first;
  `evict` drops ready slots stamped before that (and aborts in-flight ones).
  Adapted: max_inflight_prompts is the caller's window; buffer order is dispatch
  order (the group id); in-flight groups past the bound are dropped when they
  finish, not aborted (their slots stay busy: NeMo-RL's throughput can only be
  higher than here, its staleness and drops the same).
  """
  name = "nemo_windowed"
  knobs = (("max_staleness_versions", "bound"), ("sample_freshest_first", "freshest_first"))

  def __init__(self, spec: TrainBatchSpec, max_staleness_versions: int = 1,
               sample_freshest_first: bool = False):
    super().__init__(spec)
    self.bound = _int_at_least("NemoWindowedPolicy", "max_staleness_versions",
                               max_staleness_versions, 0)
    if not isinstance(sample_freshest_first, bool):
      raise ValueError(f"NemoWindowedPolicy.sample_freshest_first = {sample_freshest_first!r} "
                       "must be a bool")
    self.freshest_first = sample_freshest_first

  def _next(self, version):
    self._evict(version)
    done = self._finished_groups()
    if len(done) < self.g:
      return None
    key = ((lambda grp: (-self._stamp(grp), grp.group_id)) if self.freshest_first
           else (lambda grp: grp.group_id))
    return sorted(done, key=key)[:self.g]


@gin.configurable
class PrimeRlPolicy(_PeerRule):
  """prime-rl (PrimeIntellect-ai/prime-rl): environments are drawn by `ratio`
  (`TrainSource.next_task`: rng.choices with the ratios as weights; the old
  orchestrator/buffer.py the same), so the mix holds in expectation only: run it
  with dispatch 'ratio' (admission/dispatch.py). The scheduler before PR #2631
  (orchestrator/scheduler.py at e792f9cf^) keeps max_inflight_rollouts in flight
  whatever the version (`_schedule_next_request`), and `_update_off_policy` cancels
  a group at a weight update once its off-policy steps have reached
  max_off_policy_steps (so one more than that behind); finished rollouts wait for
  their batch and are never dropped.
  Adapted: max_inflight_rollouts is the caller's window; finished groups train in
  finish order; a group cancelled in flight is dropped when it finishes instead (its
  slot stays busy: prime-rl's throughput can only be higher than here);
  max_async_level (the orchestrator assembling batch n once checkpoint n - L exists)
  never binds here, where the trainer takes mini-batch n at version n, so it is not
  a knob.
  """
  name = "prime_rl"
  knobs = (("max_off_policy_steps", "off_policy"),)

  def __init__(self, spec: TrainBatchSpec, max_off_policy_steps: int = 8):
    super().__init__(spec)
    self.off_policy = _int_at_least("PrimeRlPolicy", "max_off_policy_steps",
                                    max_off_policy_steps, 0)

  def finished(self, group):
    dropped = super().finished(group)
    if not dropped and self._version_seen - group.version > self.off_policy:
      self._drop(group, "stale")  # cancelled in flight, at the update that passed the bound
      self._stale_untaken.pop()
      dropped = [(group, "stale")]
    return dropped

  def _next(self, version):
    done = self._by_arrival(self._finished_groups())
    return done[:self.g] if len(done) >= self.g else None


@gin.configurable
class TinkerDiscardPolicy(_PeerRule):
  """tinker-cookbook's async training before PR #822 (thinking-machines-lab/
  tinker-cookbook @9dfcc3a2, tinker_cookbook/rl/train.py,
  `filter_stale_trajectory_group`): groups are consumed first in, first out; one
  whose sampler is more than max_steps_off_policy steps behind the batch it would
  join is thrown away and its prompt rolled out again. (The snapshot holds the PR's
  changelog entry but still this code.)
  Adapted: groups_per_batch = g. tinker runs groups_per_batch rollout workers; here
  they are the caller's window (sim/peers.py gives it (L + 1) g, the capacity PR #822
  gives its pacing rule at pipeline_depth = L). The caller replaces a dropped group
  with a new one of its source, not the same problem: a problem slow by nature would
  be dropped again, so the bias measured here is the smaller one.
  """
  name = "tinker_discard"
  knobs = (("max_steps_off_policy", "bound"),)

  def __init__(self, spec: TrainBatchSpec, max_steps_off_policy: int = 1):
    super().__init__(spec)
    self.bound = _int_at_least("TinkerDiscardPolicy", "max_steps_off_policy",
                               max_steps_off_policy, 0)

  def _next(self, version):
    self._drop_older_than(version, self.bound)
    done = self._by_arrival(self._finished_groups())
    return done[:self.g] if len(done) >= self.g else None


PEER_POLICIES = (ArealPolicy, VerlPolicy, NemoWeightFifoPolicy, NemoWindowedPolicy,
                 PrimeRlPolicy, TinkerDiscardPolicy)
