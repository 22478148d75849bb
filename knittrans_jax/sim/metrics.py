"""Summary figures of a simulated run (design-notes s. 2 definitions)."""
from __future__ import annotations

import collections

import numpy as np

from knittrans_jax.admission import TrainBatchSpec
from knittrans_jax.admission.costs import quota_error, tail_bias
from knittrans_jax.admission.dispatch import quota_block
from knittrans_jax.sim.config import SimConfig
from knittrans_jax.sim.pipeline import SimResult
from knittrans_jax.sim.workload import sample_lengths


def quota_violations(result: SimResult, spec: TrainBatchSpec) -> int:
  """Complete train batches whose per-source group counts differ from the quota."""
  totals = collections.defaultdict(collections.Counter)
  for k, _, counts in result.mini_batch_counts:
    totals[k].update(counts)
  return spec.quota_violations(totals)


def summarize(result: SimResult, spec: TrainBatchSpec) -> dict:
  a = result.arch
  pos = np.maximum(a, 0)
  T = result.sim_time_s
  return {
      "mode": result.mode, "policy": result.policy, "window": result.window,
      "dispatch": result.dispatch,
      "trajectories": result.trajectories,
      "arch_staleness_mean": float(pos.mean()),
      "arch_staleness_signed_mean": float(a.mean()),
      "arch_staleness_p50": float(np.percentile(pos, 50)),
      "arch_staleness_p99": float(np.percentile(pos, 99)),
      "arch_staleness_max": int(pos.max()),
      # What would be left if every group trained as soon as it finished decoding.
      "arch_floor_mean": float(result.arch_floor.mean()),
      "staleness_mean": float((result.v_consume - result.v_gen).mean()),
      "quota_violations": quota_violations(result, spec),
      "throughput_traj_per_s": result.trajectories / T,
      "trainer_idle_frac": 1.0 - result.trainer_busy_s / T,
      "rollout_idle_frac": 1.0 - result.slot_busy_s / (result.slots * T),
      "sim_time_s": T, "dropped": result.dropped,
      # Where staleness comes from: versions that pass while a group decodes (no
      # admission policy can remove these) and the whole time in the system.
      "rollout_versions_mean": float(result.rollout_versions.mean()),
      "rollout_s_mean": float(result.rollout_s.mean()),
      "sojourn_s_mean": result.mean_sojourn_s, "in_system_mean": result.mean_in_system,
      # What the rule gives up (admission/costs.py): the mix against the quotas, and
      # which groups were trained by how long they took.
      "options": result.options or {},
      "quota_error": quota_error(result.mini_batch_counts, spec),
      "tail_bias": group_tail_bias(result),
  }


def group_tail_bias(result: SimResult) -> dict:
  """costs.tail_bias over the run's dispatched groups."""
  if result.group_fate == ():
    return tail_bias([])
  return tail_bias((result.sources[s], t, f) for s, t, f in zip(
      result.group_source, result.group_gen_s, result.group_fate))



def decode_times(config: SimConfig, per_group: int = 400) -> np.ndarray:
  """Decode times of responses (prefill + length x time per token) drawn from the
  workload's length models in the quota mix: a property of the workload, the same
  for every admission and dispatch policy. Seeded by config.seed."""
  rng = np.random.default_rng([config.seed, 7919])
  counts = collections.Counter(quota_block(config.spec, tuple(config.sources)))
  return np.concatenate([
      m.prefill_s + sample_lengths(rng, m, c * per_group) * config.time_per_token_s
      for name, c in sorted(counts.items()) for m in [config.sources[name]]])


def staleness_bound(config: SimConfig, throughput_traj_per_s: float) -> float:
  """A lower bound on the mean architectural staleness, mean max(a, 0), of any
  admission and dispatch policy that trains at `throughput_traj_per_s` or more,
  assuming the trainer steps at an even pace. It depends on the workload and the
  throughput only: one number per baseline, whatever the policy.

  With versions published every step, a trajectory started at s and trained at
  mini-batch j of train batch k has a = v_consume - v_gen - j: v_consume counts the
  steps done when it trains, at or after its own last token (s + d, d its decode
  time), and v_gen those visible at s - L (L the sync latency). Steps at an even
  rate rho = throughput / (n g), at a random phase, put rho (d + L) steps on average
  in (s - L, s + d], so (Jensen) E max(a, 0) >= E max(rho (d + L) - j, 0). Every
  train batch has one mini-batch of each j = 0..M-1 of equal size; the sum is
  smallest when the longest decodes get the largest j (sorted against sorted),
  which is what is computed. Queueing for slots, waiting for a group's other
  responses and for the trainer only add to a. A faster run has a larger rho, so
  the bound at a baseline's throughput holds for every run that matches it.
  """
  spec = config.spec
  if config.publish != "step":
    raise ValueError(f"staleness_bound assumes SimConfig.publish = 'step', not {config.publish!r}")
  rho = throughput_traj_per_s / (spec.group_size * spec.mini_batch_groups)
  x = np.sort(rho * (decode_times(config) + config.sync_latency_s))
  j = np.arange(x.size) * spec.num_mini_batches // x.size  # sorted, each j equally often
  return float(np.maximum(x - j, 0).mean())
