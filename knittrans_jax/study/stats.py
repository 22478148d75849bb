"""Statistics over seeds: bootstrap confidence intervals and the share of a gap closed.

Pure numpy, seeded: the same inputs give the same interval.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def bootstrap_ci(values: Sequence[float], level: float = 0.95, resamples: int = 10_000,
                 seed: int = 0) -> tuple[float, float]:
  """Percentile bootstrap interval of the mean over `values` (one per seed)."""
  x = np.asarray(values, float)
  if x.size == 0 or not np.isfinite(x).all():
    raise ValueError(f"bootstrap_ci needs finite values, got {list(values)}")
  if x.size == 1:
    return float(x[0]), float(x[0])
  rng = np.random.default_rng(seed)
  means = x[rng.integers(0, x.size, (resamples, x.size))].mean(axis=1)
  lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
  return float(lo), float(hi)


def gap_closed(policy: Sequence[float], baseline: Sequence[float], reference: Sequence[float],
               level: float = 0.95, resamples: int = 10_000, seed: int = 0
               ) -> tuple[float, tuple[float, float]]:
  """Share of the reference-vs-baseline gap a policy closes, (mean(p) - mean(b)) /
  (mean(r) - mean(b)), with a bootstrap interval resampling each group's seeds
  independently. 1 means the policy reaches the reference (colocated), 0 the
  baseline (train-batch admission)."""
  p, b, r = (np.asarray(v, float) for v in (policy, baseline, reference))
  if min(p.size, b.size, r.size) == 0:
    raise ValueError("gap_closed needs at least one value per group")

  def share(pm, bm, rm):
    gap = rm - bm
    return np.where(np.abs(gap) > 1e-12, (pm - bm) / np.where(gap == 0, 1, gap), np.nan)

  point = float(share(p.mean(), b.mean(), r.mean()))
  rng = np.random.default_rng(seed)
  draw = lambda v: v[rng.integers(0, v.size, (resamples, v.size))].mean(axis=1)  # noqa: E731
  boot = share(draw(p), draw(b), draw(r))
  boot = boot[np.isfinite(boot)]
  if boot.size == 0:
    return point, (float("nan"), float("nan"))
  lo, hi = np.percentile(boot, [50 * (1 - level), 50 * (1 + level)])
  return point, (float(lo), float(hi))


def linear_fit(x: Sequence[float], y: Sequence[float], level: float = 0.95,
               resamples: int = 10_000, seed: int = 0) -> tuple[float, float, tuple[float, float]]:
  """Least-squares y = intercept + slope x, with a bootstrap interval of the slope
  resampling (x, y) points (runs) together. Returns (slope, intercept, (lo, hi))."""
  x, y = np.asarray(x, float), np.asarray(y, float)
  if x.size != y.size or x.size < 3 or not (np.isfinite(x).all() and np.isfinite(y).all()):
    raise ValueError(f"linear_fit needs >= 3 finite (x, y) pairs, got {x.size} and {y.size}")
  if np.ptp(x) == 0:
    raise ValueError(f"linear_fit: every x is {x[0]}; no slope to fit")
  slope, intercept = np.polyfit(x, y, 1)
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, x.size, (resamples, x.size))
  xs, ys = x[idx], y[idx]
  xm, ym = xs.mean(axis=1, keepdims=True), ys.mean(axis=1, keepdims=True)
  sxx = ((xs - xm) ** 2).sum(axis=1)
  ok = sxx > 0  # a resample of one repeated x has no slope
  slopes = ((xs - xm) * (ys - ym)).sum(axis=1)[ok] / sxx[ok]
  lo, hi = np.percentile(slopes, [50 * (1 - level), 50 * (1 + level)])
  return float(slope), float(intercept), (float(lo), float(hi))
