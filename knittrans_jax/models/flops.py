"""Model FLOPs of a training update, and model FLOPs utilisation (MFU).

Model FLOPs of an update (PaLM's appendix B, attention counted causally within each
packed trajectory, rematerialisation not counted):

    6 * N * tokens + sum over trajectories of 6 * layers * heads * head_dim * L * (L + 1)

N: the parameters that multiply activations (every parameter but a separate input
embedding table; a tied table counts once, as the output head), tokens: the
trajectories' tokens (padding not counted), L: a trajectory's length. The first term
is 2 FLOPs per parameter per token forward and 4 backward; the second is QK^T and AV
(2 * 2 * heads * head_dim per query-key pair forward, 3x with the backward) over the
L (L + 1) / 2 causal pairs.

MFU = model FLOPs / seconds / (peak FLOP/s of one device x devices), the peak dense
bf16 FLOP/s by `jax.devices()[0].device_kind` from PEAK_FLOPS (vendor spec sheets);
a device the table does not know (a CPU) has no MFU, and says why.
"""
from __future__ import annotations

import re

import numpy as np

# Peak dense bf16 FLOP/s of one device, by device_kind (first match wins), from the
# vendors' spec sheets (NVIDIA's give "with sparsity" figures: dense is half).
PEAK_FLOPS = (
    (r"h100.*pcie", 756e12, "NVIDIA H100 PCIe datasheet: 1,513 TFLOPS bf16 with sparsity"),
    (r"h100.*nvl", 835e12, "NVIDIA H100 NVL datasheet: 1,671 TFLOPS bf16 with sparsity"),
    (r"h100", 989e12, "NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with sparsity"),
    (r"h200.*nvl", 835e12, "NVIDIA H200 NVL datasheet: 1,671 TFLOPS bf16 with sparsity"),
    (r"h200", 989e12, "NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity"),
    (r"a100", 312e12, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense"),
    (r"^tpu v4$", 275e12, "Google Cloud TPU v4 spec: 275 TFLOPS bf16 per chip"),
    (r"^tpu v5( lite|e)", 197e12, "Google Cloud TPU v5e spec: 197 TFLOPS bf16 per chip"),
    (r"^tpu v5p?$", 459e12, "Google Cloud TPU v5p spec: 459 TFLOPS bf16 per chip"),
    (r"^tpu v6( lite|e)|trillium", 918e12, "Google Cloud TPU v6e spec: 918 TFLOPS bf16 per chip"),
)


def peak_flops(device_kind: str, override: float | None = None) -> dict:
  """{'value', 'source', 'reason'}: the device's peak dense bf16 FLOP/s, or value None
  and why."""
  if override is not None:
    return {"value": float(override), "source": "--peak_flops", "reason": None}
  for pattern, value, source in PEAK_FLOPS:
    if re.search(pattern, device_kind.lower()):
      return {"value": value, "source": source, "reason": None}
  return {"value": None, "source": None,
          "reason": f"no peak FLOP/s known for device kind {device_kind!r} (PEAK_FLOPS in "
                    "knittrans_jax/models/flops.py); pass --peak_flops"}


def matmul_params(cfg, total: int) -> int:
  """N of the module doc: every parameter but a separate input embedding table."""
  return total if cfg.tie_embeddings else total - cfg.vocab_size * cfg.width


def train_flops(cfg, n_matmul: int, lengths) -> float:
  """Model FLOPs of one update on trajectories of `lengths` tokens (module doc); `cfg`:
  a DecoderConfig."""
  lengths = np.asarray(lengths, np.float64)
  pairs = float(np.sum(lengths * (lengths + 1)))  # twice the causal query-key pairs
  attention = 6.0 * cfg.depth * cfg.heads * cfg.dim_per_head * pairs
  return 6.0 * n_matmul * float(lengths.sum()) + attention


def mfu_fields(flops: float, seconds: float, peak: dict, devices: int) -> dict:
  if peak["value"] is None:
    return {"mfu": None, "mfu_reason": peak["reason"]}
  return {"mfu": flops / seconds / (peak["value"] * devices), "mfu_reason": None}
