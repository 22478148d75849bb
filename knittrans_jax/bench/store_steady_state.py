"""A trajectory store unit in steady state (scripts/bench_store.py --steady_state): a
live window of appends, everything older reclaimed into the free pools as a job's
retention does, beside np.save and a numpy copy of the same bytes."""
from __future__ import annotations

import os
import time

import numpy as np
from tqdm import tqdm

from knittrans_jax.bench.store_payloads import MiB, disk_bytes, payload_arrays, text_batch
from knittrans_jax.storage import StoreSchema, TrajectoryStore


def bench_steady_state(root: str, live_mib: float, cycles: int, seed: int = 0,
                       token_chunk: int | None = None) -> dict:
  """Appends to one unit in steady state (a live window, the rest reclaimed), beside
  np.save and a numpy copy of the same bytes. `token_chunk`: None for the default."""
  url = "file://" + os.path.join(root, "store")
  store = TrajectoryStore.create(url, StoreSchema(sources=("math",), token_chunk=token_chunk))
  schema = store.schema  # token_chunk as chosen for this store
  writer = store.writer("steady", reclaim_every_s=float("inf"))  # reclaimed below, timed apart
  npy_dir = os.path.join(root, "npsave")
  os.makedirs(npy_dir)
  rng = np.random.default_rng(seed)
  batches, arrays, live = [], [], 0
  while live < live_mib * MiB:  # one window's appends, cycled
    b = text_batch(rng, len(batches) * 2)
    arrs = payload_arrays(b)
    batches.append(b)
    arrays.append(arrs)
    live += sum(a.nbytes for a in arrs)
  window, total = len(batches), len(batches) * cycles
  dst = [np.empty(max(a[i].size for a in arrays), arrays[0][i].dtype) for i in range(3)]
  block = max(1, window // 4)  # appends, np.save and copies alternate in blocks
  commits = []
  nbytes = write_s = npsave_s = copy_s = reclaim_s = delete_s = 0.0
  released, footprint, npsave_footprint = 0, [], []
  bar = tqdm(total=total, desc="steady state", leave=False)
  for lo in range(0, total, block):
    hi = min(lo + block, total)
    for k in range(lo, hi):
      t0 = time.perf_counter()
      writer.append(batches[k % window])
      t1 = time.perf_counter()
      commits.append(writer.commit)
      if k >= window:  # appends before k - window + 1 have left the window: retention
        store.retain_from("steady", commits[k - window].rows)
        released += writer.reclaim()
      write_s += t1 - t0
      reclaim_s += time.perf_counter() - t1
      nbytes += sum(a.nbytes for a in arrays[k % window])
    t0 = time.perf_counter()
    for k in range(lo, hi):
      for name, a in zip(("tokens", "logprobs", "loss_mask"), arrays[k % window]):
        np.save(os.path.join(npy_dir, f"{k}_{name}.npy"), a)
    npsave_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in range(lo, hi):
      if k >= window:
        for name in ("tokens", "logprobs", "loss_mask"):
          os.unlink(os.path.join(npy_dir, f"{k - window}_{name}.npy"))
    delete_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in range(lo, hi):
      for d, a in zip(dst, arrays[k % window]):
        np.copyto(d[:a.size], a)
    copy_s += time.perf_counter() - t0
    for k in range(lo, hi):
      if (k + 1) % window == 0:  # a cycle done
        footprint.append(disk_bytes(os.path.join(root, "store")))
        npsave_footprint.append(disk_bytes(npy_dir))
    bar.update(hi - lo)
  bar.close()
  # What the window holds reads back as appended (a benchmark that lost rows fails here).
  reader = TrajectoryStore.open(url)
  metas = reader.list_committed("steady", live=True)[-16 * (window // 2):]
  got = reader.read(metas).result()
  first = total - window // 2
  want = [np.concatenate([arrays[k % window][0] for k in range(first, total)])]
  read_matches_written = bool(np.array_equal(np.concatenate(got.tokens), want[0]))
  after = footprint[1:] or footprint
  mb = nbytes / MiB
  result = {
      "dir": root, "live_MiB": live / MiB, "appends_per_cycle": window, "cycles": cycles,
      "appended_MiB": mb, "token_chunk": schema.token_chunk,
      "append_MBps": mb / write_s, "npsave_MBps": mb / npsave_s, "memcpy_MBps": mb / copy_s,
      "reclaim_ms_per_append": 1e3 * reclaim_s / total,
      "npsave_delete_ms_per_append": 1e3 * delete_s / total,
      "chunk_files_released": released,
      "footprint_bytes": footprint, "npsave_footprint_bytes": npsave_footprint,
      "footprint_flat": max(after) / min(after),
      "read_matches_written": read_matches_written,
  }
  result["append_vs_npsave"] = result["append_MBps"] / result["npsave_MBps"]
  result["append_vs_memcpy"] = result["append_MBps"] / result["memcpy_MBps"]
  return result

