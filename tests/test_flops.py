"""models/flops.py through the job's metrics: a step's model FLOPs from its
trajectories' lengths, over its seconds, and MFU where the device's peak is known."""
import pytest

from knittrans_jax.job.metrics import StepFlops
from knittrans_jax.models import DecoderConfig
from knittrans_jax.models.flops import peak_flops, train_flops


def test_step_flops_fields():
  cfg = DecoderConfig(vocab_size=10, width=8, depth=2, heads=2, mlp_width=16)
  flops = train_flops(cfg, 100, [3, 1])
  assert flops == 6 * 100 * 4 + 6 * 2 * 2 * 4 * (3 * 4 + 1 * 2)
  cpu = StepFlops(cfg, 100, peak_flops("cpu"), devices=8)
  assert cpu.fields([3, 1], 2.0) == {"model_flops": flops, "model_flops_per_s": flops / 2}
  h100 = StepFlops(cfg, 100, peak_flops("NVIDIA H100 80GB HBM3"), devices=2)
  assert h100.fields([3, 1], 2.0)["mfu"] == pytest.approx(flops / 2 / (989e12 * 2))
