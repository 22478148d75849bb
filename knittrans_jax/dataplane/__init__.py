"""The data plane: consumer assignment (metadata only) and on-demand prefetching reads."""
from knittrans_jax.dataplane.assignment import MicroBatchPlan, plan_micro_batches
from knittrans_jax.dataplane.reader import DataReadError, PrefetchingReader, ReaderStats

__all__ = ["DataReadError", "MicroBatchPlan", "PrefetchingReader", "ReaderStats",
           "plan_micro_batches"]
