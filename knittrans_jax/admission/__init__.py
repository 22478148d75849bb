"""Mini-batch admission over metadata: the spec, the feasibility check, the policies."""
from knittrans_jax.admission.policies import (POLICIES, AdmissionPolicy, ConstraintPreservingPolicy,
                                              FifoPolicy, TrainBatchPolicy, make_policy)
from knittrans_jax.admission.spec import InfeasibleSpecError, TrainBatchSpec
from knittrans_jax.types import GroupInfo, MiniBatch

__all__ = ["AdmissionPolicy", "ConstraintPreservingPolicy", "FifoPolicy", "GroupInfo",
           "InfeasibleSpecError", "MiniBatch", "POLICIES", "TrainBatchPolicy", "TrainBatchSpec",
           "make_policy"]
