"""Discrete-event simulator of the rollout-to-training pipeline (uses admission/)."""
from knittrans_jax.sim.config import SimConfig, SourceModel
from knittrans_jax.sim.metrics import quota_violations, summarize
from knittrans_jax.sim.pipeline import SimResult, simulate

__all__ = ["SimConfig", "SimResult", "SourceModel", "quota_violations", "simulate", "summarize"]
