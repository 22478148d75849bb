"""The data plane: consumer assignment (metadata only) and on-demand reads (host data)."""
from knittrans_jax.dataplane.assignment import MicroBatchPlan, plan_micro_batches
from knittrans_jax.dataplane.reader import (DataReadError, OnDemandReads, ReadStats,
                                            SegmentReads, describe)

__all__ = ["DataReadError", "MicroBatchPlan", "OnDemandReads", "ReadStats", "SegmentReads",
           "describe", "plan_micro_batches"]
