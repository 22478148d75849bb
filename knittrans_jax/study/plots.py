"""The study's figures (scripts/study.py): learning curves as the mean over seeds
with a shaded 95% t band, against optimizer steps and against training seconds;
final reward against mean architectural staleness: every run, each configuration's
mean and interval, and the saturating fit."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from knittrans_jax.study.stats import t_interval  # noqa: E402


def _band(curves: list[list], column: int):
  """Mean and 95% band over seeds of the reward at each evaluation (x: the mean of
  `column` over seeds; evaluations are at the same steps in every run)."""
  n = min(len(c) for c in curves)
  xs = np.mean([[c[i][column] for c in curves] for i in range(n)], axis=1)
  ys = [[c[i][2] for c in curves] for i in range(n)]
  mean = np.array([np.mean(y) for y in ys])
  ci = np.array([t_interval(y) for y in ys])
  return xs, mean, ci[:, 0], ci[:, 1]


def learning_curves(result: dict, path: str) -> None:
  names = list(result["summary"])
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
  for k, name in enumerate(names):
    curves = [r["curve"] for r in result["runs"] if r["configuration"] == name]
    color = f"C{k}"
    for ax, column in zip(axes, (0, 1)):
      x, m, lo, hi = _band(curves, column)
      ax.plot(x, m, color=color, label=f"{name} (n={len(curves)})")
      ax.fill_between(x, lo, hi, color=color, alpha=0.15, lw=0)
  thr = result.get("threshold")
  for ax, xl in zip(axes, ("optimizer step", "training wall time (s, evaluation excluded)")):
    ax.set_xlabel(xl)
    ax.grid(alpha=0.3)
    if thr is not None:
      ax.axhline(thr, color="k", ls=":", lw=1)
  axes[0].set_ylabel(f"held-out {result.get('metric', 'sampled')} reward")
  axes[0].legend(fontsize=7)
  fig.suptitle("held-out evaluation of the current policy: mean over seeds, 95% t band")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def dose_response(result: dict, path: str) -> None:
  d = result["dose_response"]
  fig, ax = plt.subplots(figsize=(6, 4.2))
  for k, name in enumerate(d["configurations"]):
    pts = [(r["arch_staleness_mean"], r["final_reward"]) for r in result["runs"]
           if r["configuration"] == name]
    ax.scatter(*zip(*pts), color=f"C{k}", s=22, label=name)
  for p in d["per_configuration"]:
    lo, hi = p["final_reward_ci95"]
    m = p["final_reward_mean"]
    ax.errorbar(p["staleness_mean"], m, yerr=[[m - lo], [hi - m]], fmt="kD", ms=5, capsize=3)
  f = d.get("fit")
  if f:
    xs = np.array([x for x, _ in d["points"]])
    grid = np.linspace(xs.min(), xs.max(), 50)
    ax.plot(grid, f["floor"] + (f["top"] - f["floor"]) * np.exp(-grid / f["scale"]), "k-",
            lw=1.2, label=f"fit: {f['floor']:.3f} + {f['top'] - f['floor']:.3f} "
            f"exp(-a / {f['scale']:.2f})")
  ax.set_xlabel("mean architectural staleness max(a, 0) of the run (versions)")
  ax.set_ylabel(f"final held-out {result.get('metric', 'sampled')} reward")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
