"""AdamW with global-norm clipping and a warmup + cosine/constant schedule, from gin."""
from __future__ import annotations

import dataclasses

import gin
import optax


@gin.configurable
@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = 1e-3
  warmup_steps: int = 0
  schedule: str = "constant"  # or 'cosine' (to 10% of the peak at total_steps)
  # 0: the run's optimizer steps, which the job sets (train_batches x num_mini_batches).
  total_steps: int = 0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  clip_norm: float | None = 1.0

  def __post_init__(self):
    if self.schedule not in ("constant", "cosine"):
      raise ValueError(f"OptimizerConfig.schedule = {self.schedule!r}: use 'constant' or 'cosine'")
    if self.learning_rate <= 0:
      raise ValueError(f"OptimizerConfig.learning_rate = {self.learning_rate} must be > 0")
    if self.total_steps < 0:
      raise ValueError(f"OptimizerConfig.total_steps = {self.total_steps} must be >= 0")

  def for_steps(self, steps: int) -> "OptimizerConfig":
    """This config with total_steps = `steps` unless the config gives its own."""
    return self if self.total_steps else dataclasses.replace(self, total_steps=int(steps))


def learning_rate(config: OptimizerConfig) -> optax.Schedule:
  if config.schedule == "cosine":
    if not config.total_steps:
      raise ValueError("OptimizerConfig.schedule = 'cosine' needs total_steps: set it, or let "
                       "the job derive it (OptimizerConfig.for_steps)")
    return optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, max(config.warmup_steps, 0),
        max(config.total_steps, config.warmup_steps + 1), end_value=0.1 * config.learning_rate)
  if config.warmup_steps:
    return optax.join_schedules([optax.linear_schedule(0.0, config.learning_rate,
                                                       config.warmup_steps),
                                 optax.constant_schedule(config.learning_rate)],
                                [config.warmup_steps])
  return optax.constant_schedule(config.learning_rate)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
  parts = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm else []
  parts.append(optax.adamw(learning_rate(config), b1=config.b1, b2=config.b2, eps=config.eps,
                           weight_decay=config.weight_decay))
  return optax.chain(*parts)
