"""The transfer figure: scripts/bench_transfer.py's centralized baselines against
on-demand reads, text and vlm (scripts/reproduce_figures.py --only transfer)."""
from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from figures_common import run_logged  # noqa: E402

# -- transfer: centralized baseline vs on-demand, text and vlm ------------------
def transfer(out: str, work: str, quick: bool) -> dict:
  results = {}
  size = ["--prompts", "8", "--mini_batches", "2"] if quick else []
  for workload in tqdm(("text", "vlm"), desc="transfer bench", unit="workload"):
    path = os.path.join(work, f"bench_transfer_{workload}.json")
    run_logged([sys.executable, "scripts/bench_transfer.py", "--workload", workload, "--json",
                 path, "--dir", os.path.join(work, f"transfer_{workload}"), *size],
                os.path.join(work, f"bench_transfer_{workload}.log"), f"bench_transfer {workload}")
    with open(path) as f:
      results[workload] = json.load(f)
  return transfer_figure(results, out)


def transfer_figure(benches: dict, out: str) -> dict:
  """transfer_latency.png from {workload: bench_transfer JSON}; returns its numbers."""
  results = {}
  sides = ("baseline", "prefetch", "ondemand")
  for workload, d in benches.items():
    side = {"baseline": d["baselines"]["centralized"],
            "prefetch": d["baselines"]["centralized_prefetch"], "ondemand": d["ondemand"]}
    results[workload] = {
        "trajectories": d["trajectories"], "consumers": d["consumers"],
        **{f"{name}_{k}": side[name][k] for name in sides
           for k in ("exposed_s", "raw_transfer_s", "total_s")},
        **{f"bytes_{name}": d["bytes_moved"][name] for name in sides},
        "exposed_ratio": d["exposed_ratio"], "raw_ratio": d["raw_ratio"],
        "prefetch_exposed_ratio": side["prefetch"]["exposed_ratio"],
        "total_ratio_vs_centralized": side["baseline"]["total_ratio"],
        "total_ratio": d["total_ratio"]}  # end to end, against the prefetching baseline
  fig, axes = plt.subplots(1, 3, figsize=(13, 4))
  workloads = list(results)
  colors = {"baseline": "tab:red", "prefetch": "tab:orange", "ondemand": "tab:blue"}
  labels = {"baseline": "centralized", "prefetch": "centralized + prefetch",
            "ondemand": "on-demand"}
  for ax, key, title in zip(axes, ("exposed_s", "raw_transfer_s", "total_s"),
                            ("exposed (the step waits)", "raw (moving the data)",
                             "total (transfer + training)")):
    x = np.arange(len(workloads))
    for i, side in enumerate(sides):
      vals = [results[w][f"{side}_{key}"] for w in workloads]
      ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=labels[side], color=colors[side])
    ax.set_xticks(x, workloads)
    if key != "total_s":
      ax.set_yscale("log")
    ax.set_ylabel("seconds, whole bench (max over consumers)")
    ax.set_title(title)
    ax.legend(fontsize=7)
  fig.suptitle("Centralized baselines vs on-demand reads (scripts/bench_transfer.py)")
  fig.tight_layout()
  fig.savefig(os.path.join(out, "transfer_latency.png"), dpi=130)
  plt.close(fig)
  return results


def transfer_section(t) -> list[str]:
  if any("prefetch_total_s" not in d for d in t.values()):  # numbers from before issue 29
    return ["## Transfer", "", "Numbers from before the prefetching baseline: remake them with "
            "`--only transfer`.", ""]
  lines = ["## Transfer: centralized baselines vs on-demand, end to end", "",
           "![transfer](transfer_latency.png)", "",
           "`python scripts/bench_transfer.py --workload text|vlm`. The headline is the total "
           "(transfer + training) against the strongest baseline, the centralized driver with "
           "one step of prefetch.", "",
           "| workload | trajectories | total s: centralized / + prefetch / on-demand | "
           "**total ratio** (vs + prefetch) | vs centralized | exposed s: centralized / + prefetch "
           "/ on-demand | MB moved: centralized (either) / on-demand |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for w, d in t.items():
    lines.append(
        f"| {w} | {d['trajectories']} | {d['baseline_total_s']:.2f} / {d['prefetch_total_s']:.2f}"
        f" / {d['ondemand_total_s']:.2f} | **{d['total_ratio']:.2f}x** | "
        f"{d['total_ratio_vs_centralized']:.2f}x | {d['baseline_exposed_s']:.3f} / "
        f"{d['prefetch_exposed_s']:.3f} / {d['ondemand_exposed_s']:.3f} | "
        f"{d['bytes_baseline'] / 1e6:.0f} / {d['bytes_ondemand'] / 1e6:.0f} |")
  lines += ["", "Seconds are summed over the whole bench (every mini-batch; the max over "
            "consumers), so a --quick run's are not comparable with a full run's. Exposed: the "
            "time a consumer's step waited for data. The vlm workload's bytes include the image "
            "copies the centralized driver sends per trajectory; `--no-dedup` compares at equal "
            "bytes (docs/dataplane.md).", ""]
  return lines
