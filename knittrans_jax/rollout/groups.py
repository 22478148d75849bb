"""One call's groups on the JAX engine: the colocated reference and held-out
evaluation (rollout workers run their own engine, rollout/worker.py).

    groups = rollout_groups(graphdef, params, version, seed, [(gid, source)], n, sampler, suite)

`suite` is the run's task suite (suites/): every group's episodes run on an agent
loop over one JAX engine holding `params` (a single-turn task is an episode of one
step), and come back as the suite's trajectories.
"""
from __future__ import annotations

from knittrans_jax.rollout.agent_loop import FailedGroup
from knittrans_jax.rollout.engine import EngineSpec
from knittrans_jax.rollout.jax_engine import JaxEngine
from knittrans_jax.rollout.sampler import SamplerConfig


def rollout_groups(graphdef, params, version: int, seed: int, requests: list[tuple[int, str]],
                   n: int, sampler: SamplerConfig, suite) -> list:
  """Generates n responses for each (group id, source) in one JAX sampler call (for
  single-turn tasks; an episode's later turns take more), the suite's RolledGroups in
  request order.

  Response i of group g samples with the key of its seed, a function of (seed, g, i)
  (engine.response_seeds, jax_engine.response_keys), so a group comes out the same
  however groups are batched into calls: a worker's few, the colocated reference's many
  (up to float reassociation in batched matmuls). An environment that fails stops
  this call (the colocated reference and evaluation have no worker to retry).
  """
  pairs = [(suite.task(seed, gid, source), gid) for gid, source in requests]
  engine = JaxEngine(EngineSpec("jax", None, sampler, seed, prompts=suite.prompt_spec,
                                rows_per_call=max(1, len(requests) * n)),
                     graphdef, params, version)
  loop = suite.agent_loop(engine, sampler)
  try:
    for task, gid in pairs:
      suite.start(loop, task, seed, gid, n)
    done = {g.group_id: g for g in loop.run()}
  finally:
    loop.close()
  failed = [g.reason for g in done.values() if isinstance(g, FailedGroup)]
  if failed:
    raise RuntimeError(f"{len(failed)} episode group(s) failed: {failed[0]}")
  return [suite.rolled(task, done[gid]) for task, gid in pairs]
