"""Staleness at matched throughput, from real runs (issue 45; the simulator's rule,
sim/sweep.py, applied to measured points).

A run record is a dict with `policy`, `dispatch`, `window` (groups in flight),
`seed`, `traj_per_s` (steady state), `arch_staleness_mean` (mean max(a, 0)),
`arch_staleness_p99` and `quota_violations`. Each configuration (policy, dispatch,
window) runs on the same seeds; its throughput is the mean over seeds, its spread
the min and max.

For train-batch admission at each baseline window (G, 2G, 4G), each dispatch of
constraint-preserving admission is read at the smallest window whose mean
throughput is at least the baseline's; the best such dispatch with no quota
violation is the matched point. Its reduction, 1 - a_cp / a_tb, is paired by seed
(mean, min, max over seeds). `within_spread` says whether the matched point's
throughput range overlaps the baseline's: if so, the runs cannot tell the two
throughputs apart and the reduction is at matched throughput within noise; a
dispatch that never reaches the baseline's throughput is reported as unmatched with
the frontier (staleness against throughput) in place of a ratio. Train-batch at the
matched window (where W >= G) shows what the window alone buys.
"""
from __future__ import annotations

import collections
from typing import Iterable, Sequence

import numpy as np

BASELINE_WINDOWS = (1, 2, 4)  # train-batch's windows, in train batches G
KEY = ("policy", "dispatch", "window")


def window_key(b: float) -> str:
  return "G" if b == 1 else f"{b:g}G"


def config_stats(runs: Iterable[dict]) -> dict[tuple, dict]:
  """{(policy, dispatch, window): {traj_per_s: {mean, min, max}, arch_staleness_mean:
  {mean, min, max}, arch_staleness_p99_mean, quota_violations (sum), by_seed}}."""
  grouped = collections.defaultdict(dict)
  for r in runs:
    grouped[tuple(r[k] for k in KEY)][r["seed"]] = r
  out = {}
  for key, by_seed in grouped.items():
    thr = [r["traj_per_s"] for r in by_seed.values()]
    stale = [r["arch_staleness_mean"] for r in by_seed.values()]
    out[key] = {"traj_per_s": _stats(thr), "arch_staleness_mean": _stats(stale),
                "arch_staleness_p99_mean": float(np.mean(
                    [r["arch_staleness_p99"] for r in by_seed.values()])),
                "quota_violations": int(sum(r["quota_violations"] for r in by_seed.values())),
                "by_seed": by_seed}
    lens = [r["response_len_mean"] for r in by_seed.values() if "response_len_mean" in r]
    if lens:  # the policy sets generation time where it sets the length
      out[key]["response_len_mean"] = float(np.mean(lens))
  return out


def _stats(x: Sequence[float]) -> dict:
  return {"mean": float(np.mean(x)), "min": float(min(x)), "max": float(max(x))}


def matched_window(stats: dict, policy: str, dispatch: str, target: float) -> int | None:
  """The smallest window of (policy, dispatch) whose mean throughput >= target."""
  windows = sorted(w for p, d, w in stats if (p, d) == (policy, dispatch))
  return next((w for w in windows if stats[(policy, dispatch, w)]["traj_per_s"]["mean"]
               >= target), None)


def _paired_reduction(cand: dict, base: dict) -> dict | None:
  seeds = sorted(set(cand["by_seed"]) & set(base["by_seed"]))
  vals = {s: 1 - cand["by_seed"][s]["arch_staleness_mean"] / base["by_seed"][s][
      "arch_staleness_mean"] for s in seeds if base["by_seed"][s]["arch_staleness_mean"] > 0}
  if not vals:
    return None
  v = list(vals.values())
  return {"mean": float(np.mean(v)), "min": min(v), "max": max(v), "by_seed": vals}


def reduction_by_baseline_window(runs: Iterable[dict], G: int,
                                 dispatches: Sequence[str] = ("shuffled", "quota_aware"),
                                 baseline_windows: Sequence[float] = BASELINE_WINDOWS) -> dict:
  """{'G': ..., '2G': ..., '4G': ...}: per baseline window, the matched point (module
  doc) and train-batch at the matched window. A baseline window not run is skipped."""
  stats = config_stats(runs)
  out = {}
  for b in baseline_windows:
    base = stats.get(("train_batch", "shuffled", int(b * G)))
    if base is None:
      continue
    target = base["traj_per_s"]["mean"]
    candidates = {}
    for d in dispatches:
      w = matched_window(stats, "constraint_preserving", d, target)
      if w is not None:
        c = stats[("constraint_preserving", d, w)]
        candidates[d] = {"window": w, "reduction": _paired_reduction(c, base),
                         "traj_per_s": c["traj_per_s"],
                         "arch_staleness_mean": c["arch_staleness_mean"],
                         "arch_staleness_p99_mean": c["arch_staleness_p99_mean"],
                         "quota_violations": c["quota_violations"]}
    keeping = {d: c for d, c in candidates.items()
               if c["quota_violations"] == 0 and c["reduction"] is not None}
    entry = {"baseline_window": int(b * G), "baseline_traj_per_s": base["traj_per_s"],
             "baseline_arch_staleness_mean": base["arch_staleness_mean"],
             "baseline_arch_staleness_p99_mean": base["arch_staleness_p99_mean"],
             "baseline_quota_violations": base["quota_violations"],
             "candidates": candidates, "matched": bool(keeping)}
    if keeping:
      best = max(keeping, key=lambda d: keeping[d]["reduction"]["mean"])
      c = keeping[best]
      entry.update(dispatch=best, matched_window=c["window"], **{
          k: c["reduction"][k] for k in ("mean", "min", "max", "by_seed")})
      entry["within_spread"] = (c["traj_per_s"]["min"] <= base["traj_per_s"]["max"])
      same = stats.get(("train_batch", "shuffled", c["window"]))
      if same is not None:  # what the window alone buys, and admission at that window
        entry["train_batch_at_matched_window"] = {
            "traj_per_s": same["traj_per_s"], "arch_staleness_mean": same["arch_staleness_mean"],
            "reduction": _paired_reduction(same, base),
            "constraint_preserving_vs_it": _paired_reduction(
                stats[("constraint_preserving", best, c["window"])], same)}
    out[window_key(b)] = entry
  return out


def frontier(runs: Iterable[dict]) -> list[dict]:
  """Every configuration's mean throughput and staleness (for the frontier plot)."""
  return [{"policy": p, "dispatch": d, "window": w, "traj_per_s": s["traj_per_s"],
           "arch_staleness_mean": s["arch_staleness_mean"],
           "quota_violations": s["quota_violations"],
           **({"response_len_mean": s["response_len_mean"]} if "response_len_mean" in s else {})}
          for (p, d, w), s in sorted(config_stats(runs).items())]


def relative_errors(pairs: Iterable[tuple[float, float]]) -> dict:
  """{mean, max} of |predicted - measured| / measured over (predicted, measured)."""
  errs = [abs(p - m) / abs(m) for p, m in pairs if m]
  return {"mean": float(np.mean(errs)), "max": float(max(errs)), "n": len(errs)} if errs else {}
