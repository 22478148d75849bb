"""The peers' admission rules on one frontier with ours, in the simulator (issue 60).

Each peer rule (admission/peers.py) is swept over its own knob; the knob's values
are chosen so that every rule spans the same in-flight range as constraint-
preserving's window sweep (g to 4G): a rule whose knob is a version gate L (AReaL's
eta, NeMo-RL's gate window) holds at most (L + 1) g groups in flight, so L = f - 1
for each window factor f of the grid; verl's counter holds int(g (1 + threshold)
trigger) groups. Gated rules get the largest window of the grid (their gate binds
inside it). Rules without a gate of their own get the window W = (L + 1) g that
their bound L implies (NeMo-RL's windowed sampler: its docs' capacity for a window
of L; tinker's old rule: the capacity PR #822 gives its replacement at
pipeline_depth = L), except prime-rl, whose knob is the window itself
(max_inflight_rollouts) at its default max_off_policy_steps.

For each point, constraint-preserving's matched reduction: its smallest swept
window whose throughput reaches the point's, on the same seed (either dispatch; the
fresher one), reduction = 1 - a_cp / a_rule on the mean of max(a, 0); "not
reached" with the reason when no window of the grid gets there, or when the rule's
own staleness is 0.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
from typing import Callable, Sequence

import numpy as np
from tqdm import tqdm

from knittrans_jax.sim.config import SimConfig
from knittrans_jax.sim.metrics import summarize
from knittrans_jax.sim.pipeline import SimulationStalled, simulate
from knittrans_jax.sim.sweep import window_grid


@dataclasses.dataclass(frozen=True)
class Rule:
  """A peer rule's sweep: admission policy, dispatch, the knob swept and its values
  from the grid's window factors, whether the rule gates starts itself, fixed options."""
  admission: str
  dispatch: str
  knob: str
  values: Callable[[Sequence[int], SimConfig], list]  # (window factors, config) -> values
  gated: bool  # True: its own gate binds inside the largest window; False: W = (L + 1) g
  fixed: tuple[tuple[str, object], ...] = ()

  def options(self, value) -> dict:
    if self.knob == "window":
      return dict(self.fixed)
    return {**dict(self.fixed), self.knob: value}

  def window_in(self, value, g: int, largest: int) -> int:
    """The window a setting runs at: the swept one (knob 'window', value in g), the
    largest (a gated rule), or the one its bound implies."""
    if self.knob == "window":
      return int(value) * g
    return largest if self.gated else (int(value) + 1) * g

  def window(self, value, config: SimConfig) -> int:
    return self.window_in(value, config.spec.mini_batch_groups, max(window_grid(config)))


def _gates(factors, config):
  return sorted({max(int(f) - 1, 0) for f in factors})


def _factors(factors, config):
  return sorted({int(f) for f in factors})


def _thresholds(factors, config):
  # int(g (1 + st) 4) = f g  ->  st = f / 4 - 1, from 0 (f <= 4) up
  return sorted({max(round(f / 4 - 1, 2), 0.0) for f in factors})


RULES = {
    "areal": Rule("areal", "shuffled", "max_head_offpolicyness", _gates, True),
    "verl": Rule("verl", "shuffled", "staleness_threshold", _thresholds, True,
                 (("trigger_parameter_sync_step", 4), ("require_batches", 1),
                  ("partial_rollout", True))),
    "nemo_weight_fifo": Rule("nemo_weight_fifo", "shuffled", "max_staleness_versions", _gates,
                             True),
    "nemo_windowed": Rule("nemo_windowed", "shuffled", "max_staleness_versions", _gates, False),
    "prime_rl": Rule("prime_rl", "ratio", "window", _factors, False,
                     (("max_off_policy_steps", 8),)),
    "tinker_discard": Rule("tinker_discard", "shuffled", "max_steps_off_policy", _gates, False),
}
OURS = ("constraint_preserving", "constraint_preserving+quota_aware")


def factors_of(config: SimConfig, up_to: float = 4) -> list[int]:
  """The window grid as multiples of g (integers: a version gate counts steps)."""
  g = config.spec.mini_batch_groups
  return sorted({max(1, round(w / g)) for w in window_grid(config, up_to=up_to)})


def _point(args) -> dict:
  config, name, admission, dispatch, window, options = args
  try:
    result = simulate(config, admission, window, dispatch=dispatch, options=options)
  except SimulationStalled as e:
    return {"rule": name, "window": window, "options": options, "seed": config.seed,
            "stalled": str(e)}
  s = summarize(result, config.spec)
  s.update(rule=name, seed=config.seed, stalled=None)
  return s


def points_for(config: SimConfig, rules: Sequence[str], up_to: float = 4,
               thin: int = 1) -> list[tuple]:
  """(config, rule, admission, dispatch, window, options) for every rule's knob value
  and constraint-preserving's every window (both dispatches); `thin` keeps every
  thin-th window factor (and the largest)."""
  factors = factors_of(config, up_to)
  factors = sorted(set(factors[::thin]) | {factors[-1]})
  jobs = []
  for name in rules:
    r = RULES[name]
    for v in r.values(factors, config):
      jobs.append((config, name, r.admission, r.dispatch, r.window(v, config), r.options(v)))
  g = config.spec.mini_batch_groups
  for name in OURS:
    admission, _, dispatch = name.partition("+")
    jobs += [(config, name, admission, dispatch or "shuffled", f * g, {}) for f in factors]
  return jobs


def run(jobs: list[tuple], workers: int | None = None, desc: str = "peers") -> list[dict]:
  """Runs the points (in parallel processes when workers > 1), with a progress bar."""
  workers = workers or min(len(jobs), os.cpu_count() or 1)
  with tqdm(total=len(jobs), desc=desc, unit="run") as bar:
    if workers <= 1:
      out = []
      for job in jobs:
        out.append(_point(job))
        bar.update()
      return out
    with mp.get_context("fork").Pool(workers) as pool:
      out = []
      for item in pool.imap(_point, jobs):
        out.append(item)
        bar.update()
      return out


def matched(point: dict, ours: list[dict]) -> dict:
  """Constraint-preserving's reduction against one rule point, on the same seed."""
  mine = [p for p in ours if p["seed"] == point["seed"] and not p["stalled"]]
  target = point["throughput_traj_per_s"]
  best = None
  for name in OURS:
    reach = sorted((p["window"], p) for p in mine if p["rule"] == name
                   and p["throughput_traj_per_s"] >= target)
    if reach and (best is None or reach[0][1]["arch_staleness_mean"]
                  < best["arch_staleness_mean"]):
      best = reach[0][1]
  a = point["arch_staleness_mean"]
  if best is None:
    top = max((p["throughput_traj_per_s"] for p in mine), default=float("nan"))
    return {"reduction": None, "reason": f"not reached: constraint-preserving's fastest "
            f"window gives {top:.2f} traj/s, the rule {target:.2f}"}
  out = {"with": best["rule"], "window": best["window"],
         "traj_per_s": best["throughput_traj_per_s"],
         "arch_staleness_mean": best["arch_staleness_mean"]}
  if a <= 0:
    return {**out, "reduction": None, "reason": "the rule's staleness is 0: nothing to reduce"}
  return {**out, "reduction": 1 - best["arch_staleness_mean"] / a, "reason": None}


def _mean(x):
  return float(np.mean(x)) if len(x) else None


def summarize_rules(points: list[dict], rules: Sequence[str]) -> dict:
  """{rule: {frontier, quota_error, tail_bias, matched_reduction, drops}} over seeds;
  constraint-preserving (each dispatch) with its own frontier and costs beside them."""
  ours = [p for p in points if p["rule"] in OURS]
  out = {}
  for name in [*rules, *(o for o in OURS if any(p["rule"] == o for p in ours))]:
    mine = [p for p in points if p["rule"] == name]
    values = sorted({_key(p) for p in mine})
    frontier, red = [], []
    for key in values:
      at = [p for p in mine if _key(p) == key and not p["stalled"]]
      if not at:
        frontier.append({"setting": dict(key), "stalled": True})
        continue
      m = [matched(p, ours) for p in at] if name not in OURS else []
      reds = [x["reduction"] for x in m if x["reduction"] is not None]
      entry = {"setting": dict(key), "window": at[0]["window"],
               "traj_per_s": _mean([p["throughput_traj_per_s"] for p in at]),
               "arch_staleness_mean": _mean([p["arch_staleness_mean"] for p in at]),
               "arch_staleness_p99": _mean([p["arch_staleness_p99"] for p in at]),
               "quota_error_mean": _qe(at, "mean"), "quota_error_max": _qe(at, "max"),
               "trained_share": _mean([p["tail_bias"]["trained_share"] for p in at
                                       if p["tail_bias"]["trained_share"] is not None]),
               "gen_s_ratio": _mean([p["tail_bias"]["gen_s_ratio"] for p in at
                                     if p["tail_bias"]["gen_s_ratio"] is not None]),
               "slowest_decile_trained_share": _mean(_slowest(at)),
               "dropped": _mean([sum(p["dropped"].values()) for p in at]),
               "seeds": sorted(p["seed"] for p in at)}
      if name not in OURS:
        entry["matched_reduction"] = {
            "mean": _mean(reds), "min": min(reds) if reds else None,
            "max": max(reds) if reds else None,
            "by_seed": {p["seed"]: x for p, x in zip(at, m)},
            "reason": None if reds else next((x["reason"] for x in m), "no runs")}
      frontier.append(entry)
    ok = [p for p in mine if not p["stalled"]]
    qe = [p["quota_error"] for p in ok if p["quota_error"] is not None]
    out[name] = {
        "knob": RULES[name].knob if name in RULES else "window",
        "dispatch": RULES[name].dispatch if name in RULES else (name.partition("+")[2]
                                                                 or "shuffled"),
        "frontier": frontier,
        "quota_error": None if not qe else {
            "mean": _mean([q["mean"] for q in qe]), "max": max(q["max"] for q in qe),
            "worst_source_max": max(q["worst_source"]["max"] for q in qe),
            "mini_batch_mean": _mean([q["mini_batch"]["mean"] for q in qe])},
        "tail_bias": _tail(ok),
        "matched_reduction": None if name in OURS else _rule_matched(frontier),
    }
  return out


def _key(p: dict) -> tuple:
  """A point's setting: the rule's options and its window."""
  return tuple(sorted({**(p.get("options") or {}), "window": p["window"]}.items()))


def _qe(points, field):
  vals = [p["quota_error"][field] for p in points if p["quota_error"] is not None]
  return _mean(vals) if field == "mean" else (max(vals) if vals else None)


def _slowest(points: list[dict]) -> list[float]:
  return [p["tail_bias"]["by_decile"][-1]["trained_share"] for p in points
          if p["tail_bias"]["by_decile"]]


def _tail(points: list[dict]) -> dict:
  """Tail bias over every point of a rule: the mean and the worst (lowest) trained
  share of the slowest decile, the lowest of any source, the trained/decided time
  ratio (mean and lowest)."""
  slow = _slowest(points)
  src = [min(p["tail_bias"]["by_source"].values()) for p in points
         if p["tail_bias"]["by_source"]]
  ratio = [p["tail_bias"]["gen_s_ratio"] for p in points
           if p["tail_bias"]["gen_s_ratio"] is not None]
  share = [p["tail_bias"]["trained_share"] for p in points
           if p["tail_bias"]["trained_share"] is not None]
  pick = lambda x: min(x) if x else None
  return {"slowest_decile_trained_share_mean": _mean(slow),
          "slowest_decile_trained_share_min": pick(slow), "gen_s_ratio_mean": _mean(ratio),
          "source_trained_share_min": pick(src), "gen_s_ratio_min": pick(ratio),
          "trained_share_min": pick(share),
          "by_point": [{"setting": p.get("options"), "seed": p["seed"],
                        **{k: p["tail_bias"][k] for k in ("trained_share", "gen_s_ratio",
                                                          "by_source", "fates")},
                        "by_decile": [d["trained_share"] for d in p["tail_bias"]["by_decile"]]}
                       for p in points]}


def _rule_matched(frontier: list[dict]) -> dict:
  """Per setting, constraint-preserving's matched reduction; the rule-level summary."""
  per = [{"setting": f["setting"], **{k: f["matched_reduction"][k] for k in (
      "mean", "min", "max", "reason")}} for f in frontier if "matched_reduction" in f]
  reached = [p["mean"] for p in per if p["mean"] is not None]
  return {"mean": _mean(reached), "min": min(reached) if reached else None,
          "max": max(reached) if reached else None, "by_setting": per,
          "reason": None if reached else next((p["reason"] for p in per if p["reason"]),
                                              "no setting ran")}
