"""The learning figures: scripts/study.py's studies of staleness and learning quality,
run (or resumed) and their figures and numbers taken over
(scripts/reproduce_figures.py --only learning learning_agentic learning_peers)."""
from __future__ import annotations

import json
import os
import shutil
import sys

from figures_common import run_logged

# -- learning: the studies of staleness and learning quality (scripts/study.py) -----
# group: (the pre-registered study, its reduced size for --quick, the figures' prefix)
STUDIES = {"learning": ("configs/study/staleness.gin", "configs/study/staleness_quick.gin",
                        "study_"),
           "learning_agentic": ("configs/study/agentic.gin", "configs/study/agentic_quick.gin",
                                "study_agentic_"),
           "learning_peers": ("configs/study/peers.gin", "configs/study/peers_quick.gin",
                              "study_peers_")}


def learning(out: str, work: str, quick: bool, group: str = "learning") -> dict:
  """Runs (or resumes) the group's study, copies its figures, returns its numbers."""
  study_gin, quick_gin, prefix = STUDIES[group]
  study_out = os.path.join(work, group + ("_quick" if quick else ""))
  if group == "learning":  # where earlier calls left this study's runs
    study_out = os.path.join(work, "study_quick" if quick else "study")
  # --quick: the machinery at a glance (a few configurations, seeds and train batches)
  cmd = [sys.executable, "scripts/study.py", "--gin_file", quick_gin if quick else study_gin,
         "--out", study_out]
  os.makedirs(study_out, exist_ok=True)
  run_logged(cmd, os.path.join(study_out, "study.log"), f"the {group} study")
  with open(os.path.join(study_out, "results.json")) as f:
    res = json.load(f)
  for name in ("learning_curves.png", "dose_response.png"):
    if os.path.exists(os.path.join(study_out, name)):
      shutil.copy(os.path.join(study_out, name), os.path.join(out, prefix + name))
  keep = ("seeds", "final_reward_mean", "final_reward_ci95", "arch_staleness_mean_mean",
          "traj_per_s_mean", "traj_per_s_ci95", "steps_to_threshold_mean",
          "steps_to_threshold_ci95", "train_s_to_threshold_mean", "reached_threshold",
          "quota_violations", "gap_closed", "gap_closed_ci95", "vs", "quota_error_mean",
          "trained_share_mean", "slowest_decile_trained_mean")
  configs = {}
  for name, s in res["summary"].items():
    c = {k: s[k] for k in keep if k in s}
    c["arch_staleness_mean"] = c.pop("arch_staleness_mean_mean", None)
    c["traj_per_s"] = c.pop("traj_per_s_mean", None)
    configs[name] = c
  return {"study_gin": quick_gin if quick else study_gin, "figure_prefix": prefix,
          "configurations": configs, "metric": res["metric"], "threshold": res["threshold"],
          "baseline": res["baseline"], "reference": res["reference"],
          "base_gin": res["base_gin"], "common_bindings": res["common_bindings"],
          "interval_method": res["interval_method"], "selection_seeds": res["selection_seeds"],
          "reported_seeds": res["reported_seeds"], "eval_train_overlap": res["eval_train_overlap"],
          "comparisons": {name: s["vs"] for name, s in res["summary"].items() if "vs" in s},
          "dose_response": res["dose_response"] and {
              k: res["dose_response"][k] for k in ("configurations", "per_configuration", "fit")},
          "table": study_table(res), "study_wall_s": res["wall_s"]}


def study_table(res) -> str:
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import study
  return study.table(res)


def learning_section(lr, title="Learning quality: does lower staleness narrow the gap to "
                     "synchronous execution?") -> list[str]:
  study_gin = lr.get("study_gin", "configs/study/staleness.gin")
  prefix = lr.get("figure_prefix", "study_")
  lines = [f"## {title}", "",
           f"`python scripts/study.py --gin_file {study_gin}` (base "
           f"`{lr['base_gin']}` with {', '.join(f'`{b}`' for b in lr['common_bindings'])}): "
           "every configuration with every seed, one run at a time; final reward = mean held-out "
           f"{lr['metric']} reward of the current policy over the last 10% of the steps. Gap "
           f"closed: share of the `{lr['reference']}` vs `{lr['baseline']}` gap in final reward, "
           f"paired by seed. Intervals: {lr.get('interval_method', 'n/a')}. Reported seeds "
           f"{lr.get('reported_seeds')}; settings chosen on seeds {lr.get('selection_seeds')}; "
           f"evaluation prompts that occur in training: {lr.get('eval_train_overlap')}. "
           "docs/learning.md reads it. The study resumes: its finished "
           "runs are read, not rerun, so the wall time in the table above is this call's; "
           "docs/learning.md gives the runs' own.", "",
           f"![learning]({prefix}learning_curves.png)", "", lr["table"], ""]
  if lr.get("dose_response"):
    lines += [f"![dose-response]({prefix}dose_response.png)", ""]
  return lines


def learning_agentic_section(lr) -> list[str]:
  return learning_section(lr, "Learning quality on multi-turn agentic episodes "
                              "(configs/agentic_tails.gin)")


def learning_peers_section(lr) -> list[str]:
  return learning_section(lr, "Learning against the strongest peer rule (issue 60; "
                              "configs/agentic_tails.gin)")
