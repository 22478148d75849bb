"""scripts/bench_multimodal.py --sweep: one knob at a time around the default point,
each point a run of the script in its own process (finished points cached beside the
JSON), the speedups plotted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from tqdm import tqdm

SWEEP = [  # (name, overrides): one knob at a time around the default
    ("n", "n", [2, 4, 8, 16]),
    ("image", "image", [224, 336, 448, 560]),
    ("vit_width", "vit_width", [32, 64, 128]),
    ("lm_width", "lm_width", [64, 128, 256, 512]),
]


def sweep(args, script: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  points, done = [], {}
  # Finished points are kept next to the JSON until the sweep completes, so an
  # interrupted sweep resumes where it stopped.
  cache_path = os.path.splitext(args.json)[0] + ".points.jsonl"
  if os.path.exists(cache_path):
    with open(cache_path) as f:
      for line in f:
        rec = json.loads(line)
        done[tuple(sorted(rec["point"].items()))] = rec["result"]
  for name, key, values in tqdm(SWEEP, desc="sweep"):
    for v in values:
      point = {k: val for k, val in vars(args).items() if k not in ("json", "dir", "sweep")}
      point[key] = v
      if key == "n":  # the same trajectories per mini-batch; only the sharing changes
        point["prompts"] = max(1, args.prompts * args.n // v)
      rows = point["prompts"] * point["n"]
      point["micro"] = min(point["micro"], rows // point["consumers"])
      cache_key = tuple(sorted(point.items()))
      if cache_key not in done:  # the default point recurs in every knob's line
        tmp = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, script, "--json", tmp]
        for k, val in point.items():
          cmd += [f"--{k}", str(val)]
        print(f"sweep {key} = {v}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(tmp) as f:
          done[cache_key] = json.load(f)
        os.remove(tmp)
        with open(cache_path, "a") as f:
          f.write(json.dumps({"point": point, "result": done[cache_key]}) + "\n")
      r = done[cache_key]
      points.append({"knob": key, "value": v, "config": point, "speedup": r["speedup"],
                     "baseline_s": r["baseline_s"], "knittrans_s": r["knittrans_s"],
                     **r["ablation"], "grad_max_rel_err": r["grad_max_rel_err"],
                     "exposed_s": r["exposed_s"], "flops": r["flops"]})
  fig, axes = plt.subplots(1, len(SWEEP), figsize=(4 * len(SWEEP), 3.4))
  for ax, (name, key, values) in zip(axes, SWEEP):
    pts = [p for p in points if p["knob"] == key]
    xs = [p["value"] for p in pts]
    ax.plot(xs, [p["speedup"] for p in pts], "o-", label="knittrans")
    ax.plot(xs, [p["baseline_s"] / p["dedup_only_s"] for p in pts], "s--", label="dedup only")
    ax.plot(xs, [p["baseline_s"] / p["ondemand_only_s"] for p in pts], "^--", label="on-demand only")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(key)
    ax.set_ylabel("speedup vs baseline")
  axes[0].legend(fontsize=8)
  fig.suptitle("transfer + training per mini-batch (scripts/bench_multimodal.py --sweep)")
  fig.tight_layout()
  png = os.path.splitext(args.json)[0] + ".png"
  fig.savefig(png, dpi=120)
  print(f"wrote {png}")
  os.remove(cache_path)  # complete: the next sweep measures afresh
  return {"points": points, "default": {k: v for k, v in vars(args).items()
                                        if k not in ("json", "dir", "sweep")}}
