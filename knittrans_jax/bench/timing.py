"""Timing helpers the benchmarks share: repeated calls, a warm-up and a budget, medians,
percentiles and a steady-state rate."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
from tqdm import tqdm


def time_calls(fn: Callable[[], object], reps: int) -> list[float]:
  """Seconds of each of `reps` calls of fn()."""
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def timed(fn: Callable[[], dict | None], reps: int, budget_s: float, desc: str,
          deadline: float = math.inf) -> dict:
  """One warm-up call (compilation), then up to `reps` timed calls while `budget_s` and
  the run's `deadline` (a time.perf_counter() value) last (one at least). fn() returns
  None or a dict of per-call figures (`extras`)."""
  t0 = time.perf_counter()
  fn()
  warmup = time.perf_counter() - t0
  times, extras = [], []
  end = min(time.perf_counter() + budget_s, deadline)
  for _ in tqdm(range(reps), desc=desc, unit="rep", leave=False):
    t = time.perf_counter()
    extras.append(fn())
    times.append(time.perf_counter() - t)
    if time.perf_counter() + times[-1] > end:  # the next rep would overrun
      break
  med = statistics.median(times)
  return {"median_s": med, "runs_s": times, "warmup_s": warmup,
          "compile_s": max(warmup - med, 0.0), "extras": extras}


def median_of(extras: list[dict], key: str) -> float:
  return float(statistics.median(e[key] for e in extras))


def percentiles(xs) -> dict:
  return {f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)}


def steady_rate(step_end_s: Sequence[float], trajectories: Sequence[int], warmup: int) -> float:
  """Trajectories per second over the steps after the first `warmup`: their trajectories
  over the time from the end of step `warmup` (from 0 with no warm-up) to the last."""
  span = step_end_s[-1] - step_end_s[warmup - 1] if warmup else step_end_s[-1]
  return sum(trajectories[warmup:]) / span
