"""The real_job figure group: staleness at matched throughput in the real job on the
workloads with tails, and the simulator's replay of every run beside it (issue 45;
scripts/real_staleness.py makes the numbers)."""
from __future__ import annotations

import json
import os
import shlex
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from figures_common import run_logged  # noqa: E402

# name: (gin file, more bindings). On long tails the policy sets the answers' lengths
# (they end where it samples EOS), so a configuration that learns differently
# generates at another speed; `long_tails_frozen` holds the policy still (a learning
# rate of 1e-9) so that every configuration generates the same distribution and
# throughput measures the pipeline alone.
WORKLOADS = {"agentic": ("configs/agentic_tails.gin", []),
             "long_tails": ("configs/text_long_tails.gin", []),
             "long_tails_frozen": ("configs/text_long_tails.gin",
                                   ["OptimizerConfig.learning_rate = 1e-9"])}
# Full size: three seeds, the steady state after the first train batches.
FULL = {"agentic": dict(train_batches=20, skip=3), "long_tails": dict(train_batches=6, skip=2),
        "long_tails_frozen": dict(train_batches=6, skip=2)}
# --quick: one seed, two train batches, the three baselines and one constraint-
# preserving window, on every workload: the path runs and each frontier is drawn, the
# figures are not the results.
QUICK = dict(seeds="0", train_batches=2, skip=1, windows="4", dispatch="shuffled",
             workloads=tuple(WORKLOADS))
STYLE = {("train_batch", "shuffled"): ("tab:red", "train_batch"),
         ("constraint_preserving", "shuffled"): ("tab:blue", "constraint_preserving"),
         ("constraint_preserving", "quota_aware"): ("tab:green",
                                                    "constraint_preserving+quota_aware")}


def real_job(out: str, work: str, quick: bool, reuse: bool = False) -> dict:
  """Runs scripts/real_staleness.py on each workload (or, with `reuse`, reads the JSON
  an earlier run of it left in `work`), draws the frontiers; returns the numbers."""
  numbers = {}
  for name, (gin_file, extra) in WORKLOADS.items():
    if quick and name not in QUICK["workloads"]:
      continue
    size = FULL[name]
    path = os.path.join(work, f"real_staleness_{name}.json")
    if reuse and os.path.exists(path):
      with open(path) as f:
        r = json.load(f)
      r.setdefault("command", command_of(r))
      frontier_plot(r, name, os.path.join(out, f"real_frontier_{name}.png"))
      numbers[name] = r
      continue
    cmd = [sys.executable, "scripts/real_staleness.py", "--gin_file", gin_file,
           "--json", os.path.join(work, f"real_staleness_{name}.json"),
           "--workdir", os.path.join(work, f"real_staleness_{name}")]
    for b in extra:
      cmd += ["--gin_bindings", b]
    if quick:
      cmd += ["--seeds", QUICK["seeds"], "--train_batches", str(QUICK["train_batches"]),
              "--skip_train_batches", str(QUICK["skip"]), "--windows", QUICK["windows"],
              "--dispatch", QUICK["dispatch"]]
    else:
      cmd += ["--train_batches", str(size["train_batches"]),
              "--skip_train_batches", str(size["skip"])]
    run_logged(cmd, os.path.join(work, f"real_staleness_{name}.log"), f"real job ({name})")
    with open(os.path.join(work, f"real_staleness_{name}.json")) as f:
      r = json.load(f)
    r.setdefault("command", command_of(r))
    frontier_plot(r, name, os.path.join(out, f"real_frontier_{name}.png"))
    numbers[name] = r
  return numbers


def command_of(r: dict) -> str:
  """The real_staleness.py command a JSON came from (its own record, or its fields)."""
  windows = ",".join(f"{w / r['g']:g}" for w in r.get("windows", [])) or "1,2,3,4,6,8,12,16"
  extra = "".join(f" --gin_bindings {shlex.quote(b)}" for b in r.get("bindings", []))
  return (f"python scripts/real_staleness.py --gin_file {r['gin_file']}{extra} --seeds "
          f"{','.join(map(str, r['seeds']))} --train_batches {r['train_batches']} "
          f"--skip_train_batches {r['skip_train_batches']} --windows {windows} --dispatch "
          f"{','.join(r.get('dispatch', ['shuffled', 'quota_aware']))}")


def frontier_plot(r: dict, name: str, path: str) -> None:
  """Mean staleness against throughput per configuration: measured (filled, with the
  seeds' throughput range) and the simulator's replay of the same runs (hollow)."""
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for (policy, dispatch), (color, label) in STYLE.items():
    for points, kind in ((r["frontier"], "measured"), (r["sim_frontier"], "simulated")):
      pts = sorted((p for p in points if (p["policy"], p["dispatch"]) == (policy, dispatch)),
                   key=lambda p: p["window"])
      if not pts:
        continue
      x = [p["traj_per_s"]["mean"] for p in pts]
      y = [p["arch_staleness_mean"]["mean"] for p in pts]
      if kind == "measured":
        err = [[xi - p["traj_per_s"]["min"] for xi, p in zip(x, pts)],
               [p["traj_per_s"]["max"] - xi for xi, p in zip(x, pts)]]
        ax.errorbar(x, y, xerr=err, color=color, marker="o", ls="-", label=f"{label}", ms=4)
        for xi, yi, p in zip(x, y, pts):
          ax.annotate(f"{p['window']}", (xi, yi), fontsize=6, xytext=(3, 3),
                      textcoords="offset points")
      else:
        ax.plot(x, y, color=color, marker="o", mfc="none", ls=":", label=f"{label} (simulated)")
  ax.set_xlabel("steady-state throughput (trajectories / s)")
  ax.set_ylabel("mean architectural staleness max(a, 0)")
  ax.set_title(f"real job, {name}: G = {r['G']}, seeds {r['seeds']} (labels: window W)",
               fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def real_job_section(numbers: dict) -> list[str]:
  lines = ["## The headline in the real job: staleness at matched throughput", "",
           "Train-batch admission at W = G, 2G and 4G against constraint-preserving "
           "admission at the smallest window whose mean throughput (over the seeds) reaches "
           "the baseline's, reductions paired by seed (`scripts/real_staleness.py`, "
           "`knittrans_jax/study/matched.py`). Throughput is steady state (the first train "
           "batches left out); each run alone on the machine. The simulator replays each "
           "run's own recorded group and step times (`knittrans_jax/sim/trace.py`).", ""]
  for name, r in numbers.items():
    lines += [f"### {name} (`{WORKLOADS[name][0]}`)", "", f"`{r['command']}`", "",
              f"![frontier {name}](real_frontier_{name}.png)", "",
              "| baseline | traj/s [min, max] | staleness | matched | traj/s [min, max] | "
              "staleness | reduction mean [min, max] | within spread | train_batch at that W |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, e in r["reduction_by_baseline_window"].items():
      t = e["baseline_traj_per_s"]
      base = (f"| train_batch W={key} ({e['baseline_window']}) | {t['mean']:.1f} "
              f"[{t['min']:.1f}, {t['max']:.1f}] | {e['baseline_arch_staleness_mean']['mean']:.2f} |")
      if not e["matched"]:
        lines.append(base + " not reached (frontier) | | | | | |")
        continue
      c = e["candidates"][e["dispatch"]]
      tb = e.get("train_batch_at_matched_window")
      tb_s = (f"{tb['traj_per_s']['mean']:.1f} traj/s, staleness "
              f"{tb['arch_staleness_mean']['mean']:.2f}" if tb else "W < G: not run")
      ct = c["traj_per_s"]
      lines.append(base + f" constraint_preserving+{e['dispatch']} W={e['matched_window']} | "
                   f"{ct['mean']:.1f} [{ct['min']:.1f}, {ct['max']:.1f}] | "
                   f"{c['arch_staleness_mean']['mean']:.2f} | {e['mean']:.3f} "
                   f"[{e['min']:.3f}, {e['max']:.3f}] | {'yes' if e['within_spread'] else 'no'} | "
                   f"{tb_s} |")
    lens = [p["response_len_mean"] for p in r["frontier"] if "response_len_mean" in p]
    if lens:
      lines += ["", f"Mean response tokens per configuration: {min(lens):.1f} to {max(lens):.1f} "
                "(the policy sets them: where they differ, so does the generation time)."]
    err = r["sim_relative_error"]
    lines += ["", f"Simulator against the job over {err.get('n', 0) // 2} runs: relative error "
              f"mean {err.get('mean', float('nan')):.3f}, worst {err.get('max', float('nan')):.3f} "
              f"(staleness mean {err['arch_staleness_mean'].get('mean', float('nan')):.3f}, "
              f"throughput mean {err['traj_per_s'].get('mean', float('nan')):.3f}).", ""]
  return lines
