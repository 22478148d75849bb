"""Deterministic trajectories for store tests: group g is always the same data."""
import numpy as np

from knittrans_jax.faults.data import SOURCES, group as faults_group  # noqa: F401
from knittrans_jax.types import Trajectory



def group(seed: int, gid: int, n: int = 4, median: int = 48) -> list[Trajectory]:
  return faults_group(seed, gid, n, median)


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
