"""The side-by-side store benchmark's payload (scripts/bench_vs_transferqueue.py): one
rep made from numpy alone, so that TransferQueue's venv and ours make the same bytes,
its CRCs, the consumers' row checks and a rep's result. Imported by path from
scripts/ (TransferQueue's venv has no knittrans_jax)."""
from __future__ import annotations

import zlib

import numpy as np

VOCAB = 32000
WORKLOAD_IDS = {"text": 1, "vlm": 2}


def make_rep(workload, rep, groups, n, prompt_len, response_len, image_shape, seed):
  """One rep's payload, from numpy alone so both venvs make the same bytes: a list of
  groups, each {gid, prompt [P], responses [n, R], logprobs [n, R], rewards [n],
  image (vlm) or None, crcs [n]}; trajectory uid = gid * n + index in group."""
  out = []
  for g in range(groups):
    rng = np.random.default_rng([seed, WORKLOAD_IDS[workload], rep, g])
    gid = rep * groups + g
    prompt = rng.integers(0, VOCAB, prompt_len, dtype=np.int32)
    responses = rng.integers(0, VOCAB, (n, response_len), dtype=np.int32)
    logprobs = -rng.random((n, response_len), dtype=np.float32)
    rewards = rng.random(n, dtype=np.float32)
    image = rng.random(image_shape, dtype=np.float32) if workload == "vlm" else None
    base = image_crc(image)
    crcs = [traj_crc(base, np.concatenate([prompt, responses[i]]), logprobs[i])
            for i in range(n)]
    out.append(dict(gid=gid, prompt=prompt, responses=responses, logprobs=logprobs,
                    rewards=rewards, image=image, crcs=crcs))
  return out


def image_crc(image) -> int:
  return 0 if image is None else zlib.crc32(np.ascontiguousarray(image).reshape(-1).view(np.uint8))


def traj_crc(base: int, tokens, response_logprobs) -> int:
  """CRC32 of a trajectory: its image's bytes (`base` = image_crc), then its token ids
  (prompt + response, int32), then its response log-probs (float32)."""
  crc = zlib.crc32(np.ascontiguousarray(tokens, np.int32).view(np.uint8), base)
  return zlib.crc32(np.ascontiguousarray(response_logprobs, np.float32).view(np.uint8), crc)


def expected_crcs(payload, n):
  return {g["gid"] * n + i: c for g in payload for i, c in enumerate(g["crcs"])}


def payload_bytes(payload, copies_per_traj: bool) -> int:
  """Bytes handed to the store: ids, log-probs, loss mask, reward, images."""
  total = 0
  for g in payload:
    n, r = g["responses"].shape
    total += n * (g["prompt"].nbytes + r * (4 + 4 + 1) + 4)
    if g["image"] is not None:
      total += g["image"].nbytes * (n if copies_per_traj else 1)
  return total


def check_rows(expected, uids, tokens, logprobs, prompt_len, images, image_of_row):
  """Checks rows against the producer's CRCs; returns (rows checked, bad uids).
  images[image_of_row[j]] is row j's image (None: no images); a distinct image index is
  hashed once."""
  bad, cache = [], {}
  for j, uid in enumerate(uids):
    base = 0
    if images is not None:
      k = image_of_row[j]
      if k not in cache:
        cache[k] = image_crc(images[k])
      base = cache[k]
    if expected.get(uid) != traj_crc(base, tokens[j], logprobs[j][prompt_len:]):
      bad.append(uid)
  return len(uids), bad



def rep_result(put_s, get_s, clear_s, consumers, put_bytes):
  return {"put_s": put_s, "get_s": get_s, "clear_s": clear_s, "end_to_end_s": put_s + get_s,
          "end_to_end_with_clear_s": put_s + get_s + clear_s,
          "get_api_s": max(r["get_api_s"] for r in consumers),
          "batch_s": max(r["batch_s"] for r in consumers),
          "put_bytes": put_bytes, "read_bytes": sum(r["bytes"] for r in consumers),
          "checked": sum(r["checked"] for r in consumers),
          "n_bad": sum(r["n_bad"] for r in consumers),
          "bad": [u for r in consumers for u in r["bad"]][:5], "consumers": consumers}

