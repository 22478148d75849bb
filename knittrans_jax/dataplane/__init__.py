"""The data plane: consumer assignment (metadata only); readers come with issue 7."""
from knittrans_jax.dataplane.assignment import MicroBatchPlan, plan_micro_batches

__all__ = ["MicroBatchPlan", "plan_micro_batches"]
