"""Summary figures of a simulated run (design-notes s. 2 definitions)."""
from __future__ import annotations

import collections

import numpy as np

from knittrans_jax.admission import TrainBatchSpec
from knittrans_jax.sim.pipeline import SimResult


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
  }
