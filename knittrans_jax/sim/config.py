"""Simulator parameters, all from gin (configs/sim/*.gin; docs/simulator.md)."""
from __future__ import annotations

import dataclasses
from typing import Mapping

import gin

from knittrans_jax.admission import TrainBatchSpec


@dataclasses.dataclass(frozen=True)
class SourceModel:
  """Response-length distribution and prompt cost of one data source.

  dist 'lognormal': median * exp(sigma * N(0, 1)); 'pareto': scale * (1 + Pareto(alpha)),
  so that `scale` is the shortest response and alpha < 2 gives a heavy tail.
  Lengths are clipped to [1, max_tokens] (a generation limit).
  """
  dist: str = "lognormal"
  median: float = 512.0  # lognormal median
  sigma: float = 0.8  # lognormal log-std
  scale: float = 256.0  # pareto minimum
  alpha: float = 1.5  # pareto tail index
  max_tokens: int = 8192
  prompt_tokens: int = 256
  prefill_s: float = 0.1  # time to prefill the prompt (images included)

  def __post_init__(self):
    if self.dist not in ("lognormal", "pareto"):
      raise ValueError(f"SourceModel.dist = {self.dist!r}: use 'lognormal' or 'pareto'")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SimConfig:
  """One disaggregated (or colocated) RL job.

  engines x slots_per_engine responses decode at once, each at time_per_token_s.
  The trainer spends trainer_fixed_s + trainer_per_token_s * tokens per mini-batch.
  Weights: a version is published after every optimizer step ('step') or after
  every train batch ('train_batch'); a request that starts at time t uses the
  newest version published by t - sync_latency_s. With interrupt_on_sync,
  in-flight requests switch to each new version as it lands (their v_gen stays the
  oldest) at interrupt_cost_s of extra decode time each.
  """
  spec: TrainBatchSpec = None
  sources: Mapping[str, Mapping] = None
  engines: int = 16
  slots_per_engine: int = 256
  time_per_token_s: float = 0.02
  trainer_fixed_s: float = 1.0
  trainer_per_token_s: float = 2e-5
  sync_latency_s: float = 2.0
  publish: str = "step"
  interrupt_on_sync: bool = False
  interrupt_cost_s: float = 0.5
  train_batches: int = 20
  seed: int = 0
  # Trace mode (sim/trace.py: what a real run recorded). group_seconds: each group's
  # n responses all take one time drawn, with replacement, from its source's recorded
  # group times (the length models and time_per_token_s then go unused);
  # train_step_seconds: each mini-batch takes a recorded step time likewise (in place
  # of trainer_fixed_s + trainer_per_token_s * tokens).
  group_seconds: Mapping[str, tuple[float, ...]] | None = None
  train_step_seconds: tuple[float, ...] | None = None

  def __post_init__(self):
    spec = self.spec if self.spec is not None else TrainBatchSpec()
    object.__setattr__(self, "spec", spec)
    if not self.sources:
      raise ValueError("SimConfig.sources is empty: give each data source a length model")
    models = {name: m if isinstance(m, SourceModel) else SourceModel(**dict(m))
              for name, m in self.sources.items()}
    object.__setattr__(self, "sources", models)
    if spec.source_quota is not None:
      unknown = set(spec.source_quota) - set(models)
      if unknown:
        raise ValueError(f"source_quota names sources without a length model: {sorted(unknown)}")
    if self.publish not in ("step", "train_batch"):
      raise ValueError(f"SimConfig.publish = {self.publish!r}: use 'step' or 'train_batch'")
    for name in ("engines", "slots_per_engine", "train_batches"):
      if getattr(self, name) <= 0:
        raise ValueError(f"SimConfig.{name} = {getattr(self, name)} must be positive")
    if self.group_seconds is not None:
      times = {k: tuple(float(t) for t in v) for k, v in self.group_seconds.items()}
      object.__setattr__(self, "group_seconds", times)
      for name in models:
        if not times.get(name) or min(times[name]) < 0:
          raise ValueError(f"SimConfig.group_seconds[{name!r}]: the trace has no times (or a "
                           f"negative one) for a source the run dispatches")
    if self.train_step_seconds is not None:
      steps = tuple(float(t) for t in self.train_step_seconds)
      object.__setattr__(self, "train_step_seconds", steps)
      if not steps or min(steps) < 0:
        raise ValueError(f"SimConfig.train_step_seconds = {steps[:4]}...: give recorded step "
                         "times, at least one, none negative")
    if self.slots < spec.group_size:
      raise ValueError(f"{self.slots} decode slots cannot hold one group of {spec.group_size}")

  @property
  def slots(self) -> int:
    return self.engines * self.slots_per_engine

  def replace(self, **changes) -> "SimConfig":
    return dataclasses.replace(self, **changes)
