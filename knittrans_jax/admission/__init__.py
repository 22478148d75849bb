"""Mini-batch admission over metadata: the spec, the feasibility check, the policies
(ours and the peers' rules)."""
from knittrans_jax.admission.policies import (AdmissionPolicy, ConstraintPreservingPolicy,
                                              FifoPolicy, TrainBatchPolicy)
from knittrans_jax.admission.registry import PEER_NAMES, POLICIES, make_policy
from knittrans_jax.admission.spec import InfeasibleSpecError, TrainBatchSpec
from knittrans_jax.types import GroupInfo, MiniBatch

__all__ = ["AdmissionPolicy", "ConstraintPreservingPolicy", "FifoPolicy", "GroupInfo",
           "InfeasibleSpecError", "MiniBatch", "PEER_NAMES", "POLICIES", "TrainBatchPolicy",
           "TrainBatchSpec", "make_policy"]
