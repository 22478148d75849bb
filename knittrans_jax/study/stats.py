"""Statistics over seeds: t and bootstrap intervals, paired differences, the share
of a gap closed, and the dose-response fit.

numpy and scipy, seeded: the same inputs give the same interval.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import scipy.optimize
import scipy.stats


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
  """Student-t interval of the mean over `values` (one per seed): with 5-10 seeds a
  percentile bootstrap is too narrow (it ignores that the spread itself is estimated)."""
  x = np.asarray(values, float)
  if x.size == 0 or not np.isfinite(x).all():
    raise ValueError(f"t_interval needs finite values, got {list(values)}")
  if x.size == 1:
    return float(x[0]), float(x[0])
  half = scipy.stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
  return float(x.mean() - half), float(x.mean() + half)


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95
                      ) -> tuple[float, tuple[float, float]]:
  """mean(a - b) over seeds run in both (same initial weights, same prompt stream),
  with its t interval: the difference one configuration makes, paired by seed."""
  a, b = np.asarray(a, float), np.asarray(b, float)
  if a.shape != b.shape or a.size == 0:
    raise ValueError(f"paired_difference needs two equal-length series, got {a.size} and {b.size}")
  d = a - b
  return float(d.mean()), t_interval(d, level)


def paired_gap_closed(policy: Sequence[float], baseline: Sequence[float],
                      reference: Sequence[float], level: float = 0.95, resamples: int = 10_000,
                      seed: int = 0) -> tuple[float, tuple[float, float]]:
  """The share of the gap closed (as gap_closed) over seeds that all three ran, with a
  BCa bootstrap interval resampling seeds, each seed's three runs together."""
  p, b, r = (np.asarray(v, float) for v in (policy, baseline, reference))
  if not p.size == b.size == r.size or p.size < 2:
    raise ValueError(f"paired_gap_closed needs the same >= 2 seeds in each group, got "
                     f"{p.size}, {b.size}, {r.size}")

  def share(pp, bb, rr, axis=-1):
    gap = rr.mean(axis) - bb.mean(axis)
    return (pp.mean(axis) - bb.mean(axis)) / np.where(np.abs(gap) > 1e-12, gap, np.nan)

  point = float(share(p, b, r))
  if not np.isfinite(point):
    return point, (float("nan"), float("nan"))
  res = scipy.stats.bootstrap((p, b, r), share, paired=True, vectorized=True, method="BCa",
                              confidence_level=level, n_resamples=resamples,
                              random_state=np.random.default_rng(seed))
  return point, (float(res.confidence_interval.low), float(res.confidence_interval.high))


def saturating_fit(x: Sequence[float], y: Sequence[float]) -> dict | None:
  """y = floor + (top - floor) exp(-x / scale): a reward that falls with staleness
  and levels off, fitted by least squares to every run. None when it does not
  converge or is not identified (fewer than 4 distinct x)."""
  x, y = np.asarray(x, float), np.asarray(y, float)
  if x.size != y.size or len(np.unique(x)) < 4:
    return None
  f = lambda x, top, floor, scale: floor + (top - floor) * np.exp(-x / scale)  # noqa: E731
  try:
    (top, floor, scale), _ = scipy.optimize.curve_fit(
        f, x, y, p0=(y.max(), y.min(), max(np.ptp(x) / 2, 1e-3)),
        bounds=([-np.inf, -np.inf, 1e-3], [np.inf, np.inf, 1e3]), maxfev=20_000)
  except (RuntimeError, ValueError):
    return None
  resid = y - f(x, top, floor, scale)
  return {"model": "floor + (top - floor) * exp(-staleness / scale)", "top": float(top),
          "floor": float(floor), "scale": float(scale),
          "rmse": float(np.sqrt(np.mean(resid ** 2)))}
