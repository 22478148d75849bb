"""models/flops.py through the job's metrics: a step's model FLOPs from its
trajectories' lengths, over its seconds, and MFU where the device's peak is known."""
import pytest

from knittrans_jax.job.metrics import StepFlops
from knittrans_jax.models import DecoderConfig
from knittrans_jax.models.flops import matmul_params, mfu_fields, peak_flops, train_flops


def test_step_flops_fields():
  cfg = DecoderConfig(vocab_size=10, width=8, depth=2, heads=2, mlp_width=16)
  flops = train_flops(cfg, 100, [3, 1])
  assert flops == 6 * 100 * 4 + 6 * 2 * 2 * 4 * (3 * 4 + 1 * 2)
  cpu = StepFlops(cfg, 100, peak_flops("cpu"), devices=8)
  assert cpu.fields([3, 1], 2.0) == {"model_flops": flops, "model_flops_per_s": flops / 2}
  h100 = StepFlops(cfg, 100, peak_flops("NVIDIA H100 80GB HBM3"), devices=2)
  assert h100.fields([3, 1], 2.0)["mfu"] == pytest.approx(flops / 2 / (989e12 * 2))


def test_peak_flops_and_mfu():
  given = peak_flops("cpu", 2e12)
  assert given == {"value": 2e12, "source": "--peak_flops", "reason": None}
  assert mfu_fields(4e12, 2.0, given, 1) == {"mfu": 1.0, "mfu_reason": None}
  assert mfu_fields(4e12, 2.0, given, 2)["mfu"] == 0.5  # every device's peak counts
  unknown = peak_flops("cpu")
  assert unknown["value"] is None and "'cpu'" in unknown["reason"]
  assert mfu_fields(1.0, 1.0, unknown, 1) == {"mfu": None, "mfu_reason": unknown["reason"]}
  for kind, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                     ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                     ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5p", 459e12),
                     ("TPU v6 lite", 918e12)):
    assert peak_flops(kind)["value"] == peak, kind
    assert "spec" in peak_flops(kind)["source"] or "datasheet" in peak_flops(kind)["source"]


def test_train_flops_formula():
  cfg = DecoderConfig(vocab_size=10, width=8, depth=2, heads=2, mlp_width=16)
  # An untied input table multiplies nothing: N leaves it out.
  assert matmul_params(cfg, 1000) == 1000 - 10 * 8
  tied = DecoderConfig(vocab_size=10, width=8, depth=2, heads=2, mlp_width=16,
                       tie_embeddings=True)
  assert matmul_params(tied, 1000) == 1000
  # Trajectories of 3 and 1 tokens: 6 N per token + 6 * layers * heads * head_dim * L (L + 1).
  assert train_flops(cfg, 100, [3, 1]) == 6 * 100 * 4 + 6 * 2 * 2 * 4 * (3 * 4 + 1 * 2)
