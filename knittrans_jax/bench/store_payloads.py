"""The trajectory store benchmark's payloads (scripts/bench_store.py): seeded batches of
trajectories, the same bytes as plain arrays (what np.save and a copy get), and the
byte counts the figures divide by.

Not storage/synthetic.random_group: these draw their lengths, log-probs and groups in
their own order, and the published figures are of these bytes."""
from __future__ import annotations

import os

import numpy as np

from knittrans_jax.types import Trajectory

MiB = 2**20
BYTES_PER_TOKEN = 4 + 4 + 1


def text_batch(rng, first_group, k=16, tokens=2048):
  out = []
  for i in range(k):
    R = int(rng.integers(tokens - 256, tokens + 256))
    out.append(Trajectory(
        prompt_tokens=rng.integers(0, 32000, 128, dtype=np.int32),
        response_tokens=rng.integers(0, 32000, R, dtype=np.int32),
        logprobs=-rng.random(R, dtype=np.float32), loss_mask=np.ones(R, bool),
        reward=float(rng.random()), source="math", group_id=first_group + i // 8,
        index_in_group=i % 8, versions=(0,)))
  return out


def image_group(rng, group_id, n, prompt=64, response=256):
  """n trajectories of one prompt (their image ids are set by the caller)."""
  tokens = rng.integers(0, 32000, prompt, dtype=np.int32)
  return [Trajectory(prompt_tokens=tokens,
                     response_tokens=rng.integers(0, 32000, response, dtype=np.int32),
                     logprobs=-rng.random(response, dtype=np.float32),
                     loss_mask=np.ones(response, bool), reward=float(rng.random()), source="math",
                     group_id=group_id, index_in_group=i, versions=(0,)) for i in range(n)]


def written_bytes() -> int | None:
  """Bytes this process has passed to write system calls (None where not counted)."""
  try:
    with open("/proc/self/io") as f:
      return int(next(line for line in f if line.startswith("wchar:")).split()[1])
  except (OSError, StopIteration):
    return None



def payload_arrays(batch: list[Trajectory]) -> list[np.ndarray]:
  """A batch's token ids, log-probs and loss mask as three flat arrays (prompt and
  response of each trajectory; zeros over the prompts): the bytes an append stores."""
  return [np.concatenate([np.concatenate([t.prompt_tokens, t.response_tokens]) for t in batch]),
          np.concatenate([np.concatenate([np.zeros(t.prompt_tokens.size, np.float32),
                                          t.logprobs]) for t in batch]),
          np.concatenate([np.concatenate([np.zeros(t.prompt_tokens.size, np.uint8),
                                          t.loss_mask.astype(np.uint8)]) for t in batch])]


def dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)



def disk_bytes(path: str) -> int:
  """Bytes the files under `path` hold on disk (allocated blocks, not their sizes)."""
  return sum(os.stat(os.path.join(d, f)).st_blocks * 512
             for d, _, files in os.walk(path) for f in files)

