"""Learning curves of one run from its metrics.jsonl: the held-out evaluation of the
current policy (job/evaluation.py), not the reward of the stale samples it trained on.

    records = read_metrics(workdir)          # knittrans_jax.job.metrics
    curve = eval_curve(records, "sampled")   # [(step, train_s, reward)]
    final_reward(curve, steps)               # mean over the last `tail` of the steps
    first_reaching(curve, 0.5)               # (step, train_s) or None

train_s is wall time since the run started minus the time spent evaluating, so
configurations compare on training time alone. Pure Python.
"""
from __future__ import annotations

METRICS = ("greedy", "sampled")


def eval_curve(records: list[dict], metric: str = "sampled") -> list[tuple[int, float, float]]:
  if metric not in METRICS:
    raise ValueError(f"evaluation metric {metric!r} is unknown; use one of {METRICS}")
  curve = [(r["step"], r["time_s"] - r.get("eval_s", 0.0), r["eval"][metric])
           for r in records if r.get("eval")]
  if not curve:
    raise ValueError("the run has no held-out evaluation: set EvalConfig.every_steps > 0")
  return curve


def final_reward(curve: list[tuple[int, float, float]], steps: int, tail: float = 0.1) -> float:
  """Mean evaluation reward over the evaluations in the last `tail` of the steps (at
  least the last one): one evaluation of 16-64 prompts per source is noisy."""
  last = [r for s, _, r in curve if s > steps * (1 - tail)] or [curve[-1][2]]
  return sum(last) / len(last)


def first_reaching(curve: list[tuple[int, float, float]], threshold: float
                   ) -> tuple[int, float] | None:
  """The first evaluation at or above `threshold`: (step, train_s); None if never."""
  for step, t, r in curve:
    if r >= threshold:
      return step, t
  return None
