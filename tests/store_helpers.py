"""Deterministic trajectories for store tests: group g is always the same data."""
import numpy as np

from knittrans_jax.storage.synthetic import random_group
from knittrans_jax.types import Trajectory

SOURCES = ("math", "code", "chat")


def group(seed: int, gid: int, n: int = 4, median: int = 48) -> list[Trajectory]:
  rng = np.random.default_rng([seed, gid])
  return random_group(rng, gid, n, SOURCES[gid % 3], prompt_len=int(rng.integers(4, 32)),
                      response_len_median=median, max_response_len=512, vocab=1000,
                      version=gid % 7)


def full_tokens(t: Trajectory) -> np.ndarray:
  return np.concatenate([t.prompt_tokens, t.response_tokens])


def check_payload(payload, seed: int, n: int = 4, median: int = 48):
  """Asserts each trajectory read equals what group() generated for it."""
  for m, toks, lps, mask in zip(payload.metas, payload.tokens, payload.logprobs,
                                payload.loss_mask):
    t = group(seed, m.group_id, n, median)[m.index_in_group]
    P = t.prompt_tokens.size
    assert m.prompt_len == P and m.response_len == t.response_tokens.size, m
    np.testing.assert_array_equal(toks, full_tokens(t), err_msg=m.id)
    np.testing.assert_array_equal(lps[P:], t.logprobs, err_msg=m.id)
    np.testing.assert_array_equal(lps[:P], 0)
    np.testing.assert_array_equal(mask[P:], t.loss_mask)
    assert not mask[:P].any()
    assert m.reward == t.reward and m.source == t.source
