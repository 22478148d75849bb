"""Deterministic trajectories for fault scenarios: group g of seed s is always the
same data, so a reader can check every row it gets back against its source."""
from __future__ import annotations

import numpy as np

from knittrans_jax.storage import StoreSchema
from knittrans_jax.storage.synthetic import random_group
from knittrans_jax.types import Payload, Trajectory

SOURCES = ("math", "code", "chat")
SCHEMA = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=4096, row_chunk=256)


def group(seed: int, gid: int, n: int = 4, median: int = 48) -> list[Trajectory]:
  rng = np.random.default_rng([seed, gid])
  return random_group(rng, gid, n, SOURCES[gid % 3], prompt_len=int(rng.integers(4, 32)),
                      response_len_median=median, max_response_len=512, vocab=1000,
                      version=gid % 7)


def mismatches(payload: Payload, seed: int, n: int = 4) -> list[str]:
  """Ids of rows whose content differs from what `group` generated for them."""
  bad = []
  for m, toks, lps in zip(payload.metas, payload.tokens, payload.logprobs):
    t = group(seed, m.group_id, n)[m.index_in_group]
    want = np.concatenate([t.prompt_tokens, t.response_tokens])
    if (toks.shape != want.shape or not np.array_equal(toks, want)
        or not np.array_equal(lps[t.prompt_tokens.size:], t.logprobs)):
      bad.append(m.id)
  return bad
