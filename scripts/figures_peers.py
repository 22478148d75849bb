"""The peers figure group (issue 60): the admission rules AReaL, verl, NeMo-RL, prime-rl
and tinker-cookbook ship, beside constraint-preserving admission on one frontier per
workload, with what each gives up (scripts/reproduce_figures.py --only peers).

  paper_text  the simulator on configs/sim/paper_text.gin
  agentic     the simulator replaying the agentic job's trace
              (configs/sim/agentic_trace/), and, where scripts/real_peers.py has run
              (its JSON in --work), the real job on configs/agentic_tails.gin
"""
from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from figures_common import ROOT  # noqa: E402
from knittrans_jax.sim import SimConfig  # noqa: E402
from knittrans_jax.sim import peers as P  # noqa: E402
from knittrans_jax.sim.trace import Trace  # noqa: E402

TRACE = os.path.join(ROOT, "configs", "sim", "agentic_trace")
REAL_JSON = "real_peers_agentic.json"  # scripts/real_peers.py's output, in --work
COLORS = {"areal": "tab:orange", "verl": "tab:green", "nemo_weight_fifo": "tab:purple",
          "nemo_windowed": "tab:pink", "prime_rl": "tab:brown", "tinker_discard": "tab:olive",
          "constraint_preserving": "tab:blue", "constraint_preserving+quota_aware": "tab:cyan"}


def sweep(config: SimConfig, seeds, thin: int, desc: str) -> dict:
  """Every rule's frontier on `config` over `seeds`, summarised (sim/peers.py)."""
  jobs = [j for s in seeds for j in P.points_for(config.replace(seed=s), list(P.RULES),
                                                 thin=thin)]
  points = P.run(jobs, desc=desc)
  return {"seeds": list(seeds), "train_batches": config.train_batches,
          "rules": P.summarize_rules(points, list(P.RULES))}


def figure(result: dict, title: str, path: str) -> None:
  """Left: staleness against throughput per rule; right: what each gives up."""
  rules = result["rules"]
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
  for name, r in rules.items():
    pts = sorted((f["traj_per_s"], f["arch_staleness_mean"]) for f in r["frontier"]
                 if not f.get("stalled"))
    ours = name.startswith("constraint_preserving")
    ax.plot([x for x, _ in pts], [y for _, y in pts], "o-" if ours else "s--",
            ms=3, lw=2 if ours else 1, color=COLORS.get(name), label=name)
  ax.set_xlabel("throughput (trajectories / s)")
  ax.set_ylabel("architectural staleness, mean of max(a, 0)")
  ax.set_title(f"{title}: each rule over its own knob", fontsize=9)
  ax.legend(fontsize=7)
  names = list(rules)
  qe = [(rules[n]["quota_error"] or {}).get("mean") or 0.0 for n in names]
  shares = [rules[n]["tail_bias"]["slowest_decile_trained_share_mean"] for n in names]
  slow = [0.0 if x is None else 1 - x for x in shares]
  xs = range(len(names))
  bx.bar([x - 0.2 for x in xs], qe, 0.4, label="quota error, mean L1 per train batch")
  bx.bar([x + 0.2 for x in xs], slow, 0.4,
         label="slowest decile's groups not trained (mean over settings)")
  bx.set_xticks(list(xs))
  bx.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
  bx.set_title("what each rule gives up (0 = nothing)", fontsize=9)
  bx.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def peers(out: str, work: str, quick: bool) -> dict:
  seeds = (0,) if quick else (0, 1, 2)
  paper = SimConfig()
  if quick:
    paper = paper.replace(train_batches=6)
  numbers = {"paper_text": {"source": "simulator, configs/sim/paper_text.gin",
                            **sweep(paper, seeds, 3 if quick else 1, "peers paper_text")}}
  trace = Trace.from_run(TRACE)
  G = trace.spec.groups_per_batch
  agentic = trace.sim_config(10 if quick else 20, 0, window=4 * G)
  sim = {"source": "simulator replaying configs/sim/agentic_trace/trace.json",
         **sweep(agentic, seeds, 1, "peers agentic")}
  real_path = os.path.join(work, REAL_JSON)
  if os.path.exists(real_path):
    with open(real_path) as f:
      real = json.load(f)
    numbers["agentic"] = {"source": f"real job: {real['command']}", **real["summary"],
                          "sim": sim}
  else:
    numbers["agentic"] = {**sim, "real_job": f"not run: {real_path} is absent "
                          "(python scripts/real_peers.py --json " + real_path + ")"}
  figure(numbers["paper_text"], "paper_text (simulator)", os.path.join(out, "peers_paper_text.png"))
  figure(numbers["agentic"], "agentic (" + ("real job" if "sim" in numbers["agentic"]
                                            else "simulator, trace mode") + ")",
         os.path.join(out, "peers_agentic.png"))
  return numbers


def _fmt(x, spec=".3f"):
  return "" if x is None else format(x, spec)


def peers_section(s) -> list[str]:
  lines = ["## Against the peers' rules", "",
           "Each peer rule (knittrans_jax/admission/peers.py) over its own knob beside "
           "constraint-preserving admission's window sweep. Matched reduction: "
           "constraint-preserving's staleness at the smallest window reaching the rule's "
           "throughput, 1 - a_cp / a_rule, paired by seed; negative where the rule is fresher.", ""]
  for workload in ("paper_text", "agentic"):
    w = s.get(workload)
    if not w:
      continue
    lines += [f"### {workload}: {w['source']}", "", f"![peers](peers_{workload}.png)", ""]
    lines += _rules_table(w["rules"])
    if "sim" in w:
      lines += ["", f"The simulator on the same workload ({w['sim']['source']}, seeds "
                f"{w['sim']['seeds']}, {w['sim']['train_batches']} train batches):", ""]
      lines += _rules_table(w["sim"]["rules"])
    if "real_job" in w:
      lines += ["", f"Real job: {w['real_job']}"]
    lines.append("")
  return lines


def _rules_table(rules: dict) -> list[str]:
  lines = ["| rule | knob | quota error (mean / max L1) | slowest decile trained, mean (min) | "
           "gen time trained / decided, mean (min) | matched reduction mean [min, max] |",
           "| --- | --- | --- | --- | --- | --- |"]
  for name, r in rules.items():
    q = r["quota_error"] or {}
    t = r["tail_bias"]
    m = r["matched_reduction"] or {}
    red = (f"{_fmt(m.get('mean'))} [{_fmt(m.get('min'))}, {_fmt(m.get('max'))}]"
           if m.get("mean") is not None else (m.get("reason") or "(ours)"))
    lines.append(f"| {name} | {r['knob']} | {_fmt(q.get('mean'))} / {_fmt(q.get('max'))} | "
                 f"{_fmt(t['slowest_decile_trained_share_mean'], '.2f')} "
                 f"({_fmt(t['slowest_decile_trained_share_min'], '.2f')}) | "
                 f"{_fmt(t['gen_s_ratio_mean'], '.2f')} ({_fmt(t['gen_s_ratio_min'], '.2f')}) | "
                 f"{red} |")
  return lines
