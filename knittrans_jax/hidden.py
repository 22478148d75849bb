"""What a model hands the loss in place of logits: the final hidden states and the
projection to the vocabulary, so the loss computes log-probs chunk by chunk and no
[B, T, vocab] array exists (rl/losses.chunked_token_logprobs).

Its own module, below models/ (which returns it) and rl/ (which reads it), so
neither imports the other.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class Projection:
  """`apply(state, h)`: the output head with its parameters `state` passed in."""
  apply: Callable
  state: Any

  def __call__(self, h):
    return self.apply(self.state, h)


@dataclasses.dataclass(frozen=True)
class Hidden:
  """What the decoder returns for the train step: the normed final hidden states
  [B, T, width] and the projection to the vocabulary."""
  states: jax.Array
  project: Projection
