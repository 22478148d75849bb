"""Window sweeps and the matched-throughput headline (design-notes s. 2).

train_batch at the baseline window (W = 2G by default; `reduction_by_window` reads
G, 2G and 4G) gives throughput T_tb and staleness a_tb. Each other policy
is read at the smallest swept W whose throughput is at least T_tb (optionally
less `match_tolerance`, a fraction; 0 by default); its staleness a_p gives
reduction = 1 - a_p / a_tb, on the mean of max(a, 0). A policy that never
reaches T_tb is read at its highest-throughput point and marked matched = False.

A "policy" here is an admission policy with a dispatch policy (admission/dispatch.py):
'constraint_preserving' (shuffled dispatch, the data loader) or
'constraint_preserving+quota_aware'. The baseline is always train_batch with
shuffled dispatch; train_batch+quota_aware is reported beside it so a gain is
attributed to the right lever. The per-run counterfactual: each point's
`arch_floor_mean` (the same run's groups, each trained the moment it finished
decoding, at the versions that run reached) is what that run would have had with
no admission wait. It is NOT a lower bound across policies: another policy changes
the trainer's timeline, and can go below it (fifo and constraint_preserving +
quota_aware do at matched throughput). `counterfactual_reduction` and
`fraction_of_counterfactual` are named for what they are.

The policy-independent bound (metrics.staleness_bound): at the baseline's
throughput, no policy that matches it gets below `bound` (assuming an evenly
stepping trainer); `bound_reduction` = 1 - bound / a_tb is the most any policy could
reduce staleness against that baseline, and `fraction_of_bound` a policy's share of
it. `runs_below_bound` counts sweep points whose staleness is under the bound at
their own throughput: the assumption checked on the data (0 expected).
"""
from __future__ import annotations

import multiprocessing as mp
import os
from typing import Iterable, Sequence

from tqdm import tqdm

from knittrans_jax.sim.config import SimConfig
from knittrans_jax.sim.metrics import staleness_bound, summarize
from knittrans_jax.sim.pipeline import SimulationStalled, simulate

POLICIES = ("train_batch", "fifo", "constraint_preserving")
# Admission x dispatch combinations the sweeps report.
COMBOS = ("train_batch", "train_batch+quota_aware", "fifo", "fifo+quota_aware",
          "constraint_preserving", "constraint_preserving+quota_aware")


def split(name: str) -> tuple[str, str]:
  """'constraint_preserving+quota_aware' -> (admission, dispatch)."""
  admission, _, dispatch = name.partition("+")
  return admission, dispatch or "shuffled"


BASELINE_WINDOWS = (1, 2, 4)  # train_batch's window, in train batches G


def window_grid(config: SimConfig, factors: Sequence[float] = (
    1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64),
    up_to: float = 4) -> list[int]:
  """Windows as multiples of g, up to `up_to` G (the largest baseline window), always
  including each baseline window."""
  g, G = config.spec.mini_batch_groups, config.spec.groups_per_batch
  grid = {max(g, int(round(f * g))) for f in factors if f * g <= up_to * G}
  return sorted(grid | {int(b * G) for b in BASELINE_WINDOWS if b <= up_to})


def _run(args):
  config, policy, window, mode = args
  admission, dispatch = split(policy)
  try:
    result = simulate(config, admission, window, mode, dispatch=dispatch)
  except SimulationStalled as e:
    # A window too small for the policy's constraints: every slot of the window
    # holds groups that can never form an admissible mini-batch.
    return {"mode": mode, "policy": policy, "window": window, "stalled": str(e)}, None
  summary = summarize(result, config.spec)
  summary.update(policy=policy, admission=admission, stalled=None)
  return summary, result


def run_points(config: SimConfig, points: Iterable[tuple], workers: int | None = None,
               progress=None) -> list:
  """Runs (policy, window, mode) points, in parallel processes when workers > 1."""
  jobs = [(config, p, w, m) for p, w, m in points]
  workers = workers or min(len(jobs), os.cpu_count() or 1)
  if workers <= 1:
    out = []
    for job in jobs:
      out.append(_run(job))
      if progress:
        progress()
    return out
  with mp.get_context("fork").Pool(workers) as pool:
    out = []
    for item in pool.imap(_run, jobs):
      out.append(item)
      if progress:
        progress()
    return out


def _bisect_policy(args):
  config, policy, lo, hi, target, steps = args
  found = []
  for _ in range(steps):
    if hi - lo <= 1:
      break
    mid = (lo + hi) // 2
    summary, _ = _run((config, policy, mid, "disaggregated"))
    found.append(summary)
    if not summary["stalled"] and summary["throughput_traj_per_s"] >= target:
      hi = mid
    else:
      lo = mid
  return found


def refine(points: list[dict], config: SimConfig, policies: Sequence[str],
           match_tolerance: float = 0.0, steps: int = 5, workers: int | None = None,
           baseline_window: int | None = None) -> list[dict]:
  """Bisects the window of each policy between the last swept W below the baseline
  throughput (train_batch at `baseline_window`, default 2G) and the first at or above
  it, so the matched point does not depend on the coarseness of the grid. Returns
  the extra points."""
  G = config.spec.groups_per_batch
  bw = baseline_window or 2 * G
  ok = [p for p in points if p["mode"] == "disaggregated" and not p["stalled"]]
  base = next(p for p in ok if p["policy"] == "train_batch" and p["window"] == bw)
  target = base["throughput_traj_per_s"] * (1 - match_tolerance)
  jobs = []
  for name in policies:
    if name == "train_batch":  # the baseline is read at its window, not matched
      continue
    sweep = sorted((p["window"], p) for p in ok if p["policy"] == name)
    above = [w for w, p in sweep if p["throughput_traj_per_s"] >= target]
    if not above:
      continue
    below = [w for w, p in sweep if w < above[0]]
    lo = below[-1] if below else config.spec.mini_batch_groups - 1
    jobs.append((config, name, lo, above[0], target, steps))
  if not jobs:
    return []
  workers = workers or min(len(jobs), os.cpu_count() or 1)
  if workers <= 1:
    return [p for job in jobs for p in _bisect_policy(job)]
  with mp.get_context("fork").Pool(workers) as pool:
    return [p for found in pool.map(_bisect_policy, jobs) for p in found]


def headline(points: list[dict], config: SimConfig, match_tolerance: float = 0.0,
             baseline_window: int | None = None) -> dict:
  """Matched-throughput and same-window comparisons against train_batch at
  `baseline_window` (default W = 2G)."""
  G = config.spec.groups_per_batch
  bw = baseline_window or 2 * G
  by = {(p["policy"], p["window"]): p for p in points
        if p["mode"] == "disaggregated" and not p["stalled"]}
  base = by[("train_batch", bw)]
  target = base["throughput_traj_per_s"] * (1 - match_tolerance)
  policies = {}
  for name in sorted({p for p, _ in by}):
    sweep = sorted((w, by[(name, w)]) for p, w in by if p == name)
    matched = [pt for w, pt in sweep if pt["throughput_traj_per_s"] >= target]
    point = dict(matched[0] if matched else max(
        (pt for _, pt in sweep), key=lambda pt: pt["throughput_traj_per_s"]))
    point["matched"] = bool(matched)
    policies[name] = point
  a_tb = base["arch_staleness_mean"]
  bound = staleness_bound(config, base["throughput_traj_per_s"])
  bound_reduction = (1 - bound / a_tb) if a_tb else None
  for name, pt in policies.items():
    pt["admission"], pt["dispatch"] = split(name)
    pt["reduction"] = (1 - pt["arch_staleness_mean"] / a_tb) if a_tb else None
    floor = (1 - pt["arch_floor_mean"] / a_tb) if a_tb else None
    pt["counterfactual_reduction"] = floor
    pt["fraction_of_counterfactual"] = (pt["reduction"] / floor) if floor else None
    pt["fraction_of_bound"] = (pt["reduction"] / bound_reduction) if bound_reduction else None
  # The headline: the best matched combination that keeps every quota.
  keeping = [(pt["reduction"], name) for name, pt in policies.items()
             if name != "train_batch" and pt["matched"] and pt["quota_violations"] == 0
             and pt["reduction"] is not None]
  best = max(keeping)[1] if keeping else None
  same = by.get(("constraint_preserving", bw))
  ours = policies.get(best) if best else None
  return {
      "baseline_window": bw, "baseline_throughput_traj_per_s": base["throughput_traj_per_s"],
      "match_tolerance": match_tolerance, "policies": policies, "best": best,
      "reduction_vs_train_batch": ours["reduction"] if ours else None,
      "counterfactual_reduction": ours["counterfactual_reduction"] if ours else None,
      "fraction_of_counterfactual": ours["fraction_of_counterfactual"] if ours else None,
      "reduction_same_window": (1 - same["arch_staleness_mean"] / a_tb) if same and a_tb else None,
      "bound": bound, "bound_reduction": bound_reduction,
      "fraction_of_bound": ours["fraction_of_bound"] if ours else None,
  }


def runs_below_bound(points: list[dict], config: SimConfig) -> list[tuple[str, int]]:
  """(policy, window) of every disaggregated point whose staleness is below the
  bound at its own throughput: where the even-stepping assumption fails."""
  return [(p["policy"], p["window"]) for p in points
          if p["mode"] == "disaggregated" and not p["stalled"]
          and p["arch_staleness_mean"] < staleness_bound(config, p["throughput_traj_per_s"])]


def reduction_by_window(points: list[dict], config: SimConfig, match_tolerance: float = 0.0,
                        windows: Sequence[float] = BASELINE_WINDOWS) -> dict:
  """{'1G': ..., '2G': ..., '4G': ...}: the headline with train_batch at each window
  (the best quota-keeping combination at matched throughput, and
  constraint_preserving at the same window). A baseline window outside the swept
  grid is skipped."""
  G = config.spec.groups_per_batch
  have = {p["window"] for p in points if p["policy"] == "train_batch" and not p["stalled"]
          and p["mode"] == "disaggregated"}
  out = {}
  for b in windows:
    if int(b * G) not in have:
      continue
    h = headline(points, config, match_tolerance, baseline_window=int(b * G))
    out[f"{b:g}G"] = {"window": int(b * G), "best": h["best"],
                      "reduction": h["reduction_vs_train_batch"],
                      "reduction_same_window": h["reduction_same_window"],
                      "bound": h["bound"], "bound_reduction": h["bound_reduction"],
                      "fraction_of_bound": h["fraction_of_bound"],
                      "baseline_throughput_traj_per_s": h["baseline_throughput_traj_per_s"]}
  return out


def sweep_points(config: SimConfig, policies, windows, workers=None, match_tolerance=0.0,
                 refine_steps=5, desc="sweep") -> list[dict]:
  """Every policy at every window (train_batch only from G), colocated, and the matched
  point bisected against each baseline window in the grid; with a progress bar."""
  G = config.spec.groups_per_batch
  # train_batch needs a whole train batch in flight: W >= G.
  points = [(p, w, "disaggregated") for p in policies for w in windows
            if split(p)[0] != "train_batch" or w >= G]
  points.append(("train_batch", None, "colocated"))
  with tqdm(total=len(points), desc=desc, unit="run") as bar:
    results = run_points(config, points, workers, progress=bar.update)
  summaries = [s for s, _ in results]
  if refine_steps:  # the matched point bisected for each baseline window
    for b in BASELINE_WINDOWS:
      if int(b * G) in windows:
        summaries += refine(summaries, config, policies, match_tolerance, refine_steps, workers,
                            baseline_window=int(b * G))
  return summaries


def over_seeds(by_seed: dict) -> dict:
  """{'1G': {'mean', 'min', 'max', 'by_seed'}, ...} of the reduction at each baseline
  window, from {seed: reduction_by_window(...)}."""
  out = {}
  for key in sorted({k for r in by_seed.values() for k in r}):
    entry = {}
    for field in ("reduction", "bound_reduction"):
      vals = {seed: r[key][field] for seed, r in by_seed.items()
              if key in r and r[key][field] is not None}
      if vals:
        v = list(vals.values())
        stats = {"mean": sum(v) / len(v), "min": min(v), "max": max(v), "by_seed": vals}
        entry.update(stats) if field == "reduction" else entry.update({field: stats})
    if entry:
      out[key] = entry
  return out
