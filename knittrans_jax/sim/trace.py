"""Trace mode: the simulator replaying what a real run recorded, to check it against
the job (issue 45).

    predicted = predict("runs/agentic", "train_batch", window=32, dispatch="shuffled",
                        seed=0, train_batches=20, skip_steps=12)   # the run's trace.json

A run's `trace.json` (job/driver.write_trace) holds its shape (G, M, n, quotas,
workers, groups per engine call, engine, suite) and what it measured: each finished
group's generation time as its worker timed it (decode time, or an episode group's
start to its last episode's end; None when the call also compiled) and each optimizer
step's time on the driver (launch to fetched sums, plus publishing the weights).

The replay keeps the real admission and dispatch code (sim/pipeline.py) and replaces
the models of decode and training with draws from those recordings: a group takes a
recorded time of its source, a step a recorded step time. Rollout capacity is the
job's: `workers` engines, each running `groups_per_call` groups at once with the JAX
engine's static batches, or every group it is sent (vLLM's continuous batching, an
agent loop's concurrent episodes). A version is visible to a group that starts after
it is published (the workers load weights between engine steps).

What it leaves out (where its predictions can err): rollout and training sharing the
machine's cores (a recorded time is its run's, under that run's contention); the
controller's per-worker queues (the simulator keeps one queue for all workers);
generation times that depend on how many groups run together (recorded at one
window, replayed at another); start-up and compilation (steady state only).
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from knittrans_jax.admission import TrainBatchSpec
from knittrans_jax.sim.config import SimConfig, SourceModel
from knittrans_jax.sim.metrics import quota_violations
from knittrans_jax.sim.pipeline import SimResult, simulate


class TraceError(ValueError):
  """A run directory without a usable trace; names the file and what is missing."""


@dataclasses.dataclass(frozen=True)
class Trace:
  spec: TrainBatchSpec
  workers: int
  concurrent_groups: int | None  # per worker; None: every group it is sent
  group_seconds: dict[str, tuple[float, ...]]
  step_seconds: tuple[float, ...]
  window: int  # the recorded run's groups in flight
  policy: str
  dispatch: str

  @classmethod
  def from_run(cls, workdir: str, skip_steps: int | None = None) -> "Trace":
    """The trace of run `workdir`. The first `skip_steps` steps' times are left out
    (default: the first train batch's, which compile); so are groups whose generation
    was not timed (their call compiled)."""
    path = os.path.join(workdir, "trace.json")
    if not os.path.isfile(path):
      raise TraceError(f"{path} does not exist: runs write it since issue 45 (job/driver.py)")
    with open(path) as f:
      raw = json.load(f)
    spec = TrainBatchSpec(**raw["spec"])
    skip = spec.num_mini_batches if skip_steps is None else skip_steps
    steps = tuple(raw["step_seconds"][skip:])
    if not steps:
      raise TraceError(f"{path}: {len(raw['step_seconds'])} step times, none after the first "
                       f"{skip} left out")
    times: dict[str, list[float]] = {}
    for g in raw["groups"]:
      if g["seconds"] is not None:
        times.setdefault(g["source"], []).append(float(g["seconds"]))
    missing = sorted(set(spec.source_quota or {}) - set(times))
    if missing:
      raise TraceError(f"{path}: no timed group of source(s) {missing}")
    batched = raw["engine"] == "jax" and raw["suite"] != "agentic"
    return cls(spec, int(raw["workers"]), int(raw["groups_per_call"]) if batched else None,
               {k: tuple(v) for k, v in times.items()}, steps, int(raw["window"]),
               raw["policy"], raw["dispatch"])

  def sim_config(self, train_batches: int, seed: int = 0, window: int | None = None) -> SimConfig:
    """A SimConfig that replays this trace for `train_batches`; `window` (default the
    recorded one) only sizes the slots of engines that run every group they are sent."""
    n = self.spec.group_size
    per_worker = self.concurrent_groups or max(window or 0, self.window, 1)
    # interrupt_cost_s 0: the job's engines take new weights between calls (an episode
    # at its next turn) at no cost of their own; a recorded time already holds the rest.
    return SimConfig(spec=self.spec, sources={s: SourceModel() for s in self.group_seconds},
                     engines=self.workers, slots_per_engine=per_worker * n,
                     sync_latency_s=0.0, interrupt_cost_s=0.0,
                     train_batches=train_batches, seed=seed,
                     group_seconds=self.group_seconds, train_step_seconds=self.step_seconds)


def steady_state(result: SimResult, spec: TrainBatchSpec, skip_steps: int,
                 train_batches: int | None = None) -> dict:
  """The figures a real run reports, measured the way the job's benchmarks measure
  them, over its first `train_batches` (default all simulated): throughput over the
  steps after `skip_steps`, mean and p99 architectural staleness max(a, 0) over every
  trajectory trained, quota violations.

  A simulation stops dispatching at its target, so its last W / G train batches drain
  the window; the job keeps it full to the end. Simulate W / G + 1 train batches more
  than the run had and read the run's own (predict does)."""
  M = spec.num_mini_batches
  steps = len(result.step_end_s) if train_batches is None else train_batches * M
  ends = result.step_end_s[:steps]
  if len(ends) < steps or steps <= skip_steps + 1:
    raise ValueError(f"{len(ends)} simulated steps of the {steps} asked for, not more than the "
                     f"{skip_steps} skipped + 1")
  per_step = spec.mini_batch_groups * spec.group_size
  t0 = ends[skip_steps - 1] if skip_steps else 0.0
  keep = result.train_batch < steps // M
  pos = np.maximum(result.arch[keep], 0)
  counts = dataclasses.replace(result, mini_batch_counts=[
      c for c in result.mini_batch_counts if c[0] < steps // M])
  return {"traj_per_s": per_step * (steps - skip_steps) / (ends[-1] - t0),
          "arch_staleness_mean": float(pos.mean()),
          "arch_staleness_p99": float(np.percentile(pos, 99)),
          "quota_violations": quota_violations(counts, spec)}


def predict(workdir: str, policy: str, window: int, dispatch: str, seed: int,
            train_batches: int, skip_steps: int, options: dict | None = None) -> dict:
  """The simulator's figures for a run of `train_batches` at this configuration
  (`options`: a peer rule's knobs), replaying the trace of run `workdir`
  (steady_state's, with the drain left out)."""
  trace = Trace.from_run(workdir)
  extra = -(-window // trace.spec.groups_per_batch) + 1
  result = simulate(trace.sim_config(train_batches + extra, seed, window), policy,
                    window=window, dispatch=dispatch, options=options)
  return steady_state(result, trace.spec, skip_steps, train_batches)
