"""The multimodal figure: scripts/bench_multimodal.py's transfer + training per
mini-batch, baseline, both ablations and knittrans
(scripts/reproduce_figures.py --only multimodal)."""
from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from figures_common import run_logged  # noqa: E402

# -- multimodal: transfer + training per mini-batch with the ablations ----------
MM_VARIANTS = (("baseline", "baseline_s"), ("ondemand_only", "ondemand_only_s"),
               ("dedup_only", "dedup_only_s"), ("knittrans", "knittrans_s"))


def multimodal(out: str, work: str, quick: bool) -> dict:
  path = os.path.join(work, "bench_multimodal.json")
  size = ["--image", "224", "--prompts", "8"] if quick else []
  bar = tqdm(total=1, desc="multimodal bench", unit="run")
  run_logged([sys.executable, "scripts/bench_multimodal.py", "--json", path,
               "--dir", os.path.join(work, "multimodal"), *size],
              os.path.join(work, "bench_multimodal.log"), "bench_multimodal")
  bar.update()
  bar.close()
  with open(path) as f:
    return multimodal_figure(json.load(f), out)


def multimodal_figure(d: dict, out: str) -> dict:
  """multimodal_step.png from a bench_multimodal JSON; returns its numbers."""
  per = {name: d[key] if key in d else d["ablation"][key] for name, key in MM_VARIANTS}
  exposed = d["exposed_s"]
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  names = [n for n, _ in MM_VARIANTS]
  exp = [exposed[n] for n in names]  # the bench reports both per mini-batch
  ax.bar(names, [per[n] - e for n, e in zip(names, exp)], color="tab:blue", label="compute")
  ax.bar(names, exp, bottom=[per[n] - e for n, e in zip(names, exp)], color="tab:red",
         label="exposed transfer")
  for i, n in enumerate(names):
    ax.text(i, per[n], f"{per['baseline'] / per[n]:.2f}x", ha="center", va="bottom")
  ax.set_ylabel("seconds per mini-batch (transfer + training)")
  c = d["config"]
  ax.set_title(f"VLM mini-batch: {c['prompts']} prompts x n = {c['n']}, {c['image']} px "
               "(scripts/bench_multimodal.py)", fontsize=9)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "multimodal_step.png"), dpi=130)
  plt.close(fig)
  return {"config": c, "seconds_per_mini_batch": per, "exposed_s_per_mini_batch": dict(
      zip(names, exp)), "speedup": d["speedup"], "grad_max_rel_err": d["grad_max_rel_err"],
          "encoder_forwards": d["encoder_forwards"],
          "encoder_share_naive": d["flops"]["encoder_share_naive"]}


def multimodal_section(m) -> list[str]:
  c = m["config"]
  lines = ["## Multimodal: transfer + training per mini-batch, with the ablations", "",
           "![multimodal](multimodal_step.png)", "",
           f"{c['consumers']} consumers, {c['prompts']} prompts x n = {c['n']}, {c['image']} px "
           f"images, patch {c['patch']}, merge {c['merge']}, ViT / LM width {c['vit_width']} / "
           f"{c['lm_width']}; mean of {c['mini_batches']} mini-batches.", "",
           "| variant | s per mini-batch | of it exposed transfer (s) | speedup vs baseline |",
           "| --- | --- | --- | --- |"]
  per = m["seconds_per_mini_batch"]
  for name, sec in per.items():
    lines.append(f"| {name} | {sec:.2f} | {m['exposed_s_per_mini_batch'][name]:.2f} | "
                 f"{per['baseline'] / sec:.2f}x |")
  lines += ["", f"Gradient of the encode-once step against the naive one: max relative error "
            f"{m['grad_max_rel_err']:.1e}. Encoder forwards per mini-batch: "
            f"{m['encoder_forwards']['baseline']} -> {m['encoder_forwards']['knittrans']}. The "
            f"encoder is {100 * m['encoder_share_naive']:.0f}% of the naive step's forward FLOPs.",
            "", "How the speedup moves with n, image size and the encoder/backbone widths: "
            "![sweep](multimodal_sweep.png) (`python scripts/bench_multimodal.py --sweep --json "
            "figures/multimodal_sweep.json`, about 30 min here; not rerun by this script).", ""]
  return lines
