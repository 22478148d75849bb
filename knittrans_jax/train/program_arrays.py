"""What a traced program forms: the largest vocabulary-sized activation.

The train step should never hold [B, T, vocab] logits (rl/losses.chunked_token_logprobs);
this walks a function's jaxpr, nested calls, scans and remat included, and finds the
largest array of three or more dimensions with a `vocab`-sized axis (parameters
and their gradients are two-dimensional, so they do not count). Used by
scripts/plan_layout.py (`logits_materialised`) and the tests.
"""
from __future__ import annotations

import math

import jax
from jax.extend.core import jaxprs_in_params


def _shapes(jaxpr):
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield getattr(v.aval, "shape", ())
    for sub in jaxprs_in_params(eqn.params):
      yield from _shapes(sub)


def largest_vocab_activation(fn, *args, vocab: int) -> tuple[int, ...]:
  """The shape of the largest array of >= 3 dims with an axis of size `vocab` that
  `fn(*args)` forms (() if none). Tracing only: nothing is compiled or run."""
  found = [s for s in _shapes(jax.make_jaxpr(fn)(*args).jaxpr) if len(s) >= 3 and vocab in s]
  return max(found, key=math.prod, default=())
