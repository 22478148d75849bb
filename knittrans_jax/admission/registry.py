"""Every admission policy by name: ours (policies.py) and the peers' rules (peers.py)."""
from __future__ import annotations

from knittrans_jax.admission.peers import PEER_POLICIES
from knittrans_jax.admission.policies import (AdmissionPolicy, ConstraintPreservingPolicy,
                                              FifoPolicy, TrainBatchPolicy)
from knittrans_jax.admission.spec import TrainBatchSpec

OURS = (TrainBatchPolicy, FifoPolicy, ConstraintPreservingPolicy)
POLICIES = {p.name: p for p in (*OURS, *PEER_POLICIES)}
PEER_NAMES = tuple(p.name for p in PEER_POLICIES)


def make_policy(name: str, spec: TrainBatchSpec, **options) -> AdmissionPolicy:
  """The policy `name`; `options` are a peer rule's knobs (unset ones come from gin,
  e.g. `ArealPolicy.max_head_offpolicyness = 4`)."""
  if name not in POLICIES:
    raise ValueError(f"unknown admission policy {name!r}; choose one of {sorted(POLICIES)}")
  if options and POLICIES[name] in OURS:
    raise ValueError(f"admission policy {name!r} takes no options (got {sorted(options)})")
  return POLICIES[name](spec, **options)
