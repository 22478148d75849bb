"""Trajectory store benchmark: append, sequential read, micro-batch read, vs memcpy.

  python scripts/bench_store.py --json runs/bench_store.json [--mib 64] [--dir DIR]

Everything is measured in this one run on the same bytes:
  write_MBps            appends of 16 trajectories (~2k tokens each) to one unit
  read_MBps             one read of a whole unit (64 MiB of payload by default)
                        All read and copy figures are medians of interleaved reps.
  microbatch_read_MBps  random sets of 16 trajectories (~2k tokens each)
  memcpy_MBps           numpy copy of the same payload arrays into fresh arrays
                        (a read also returns fresh arrays); the copy into
                        preallocated arrays is reported beside it
  read_vs_memcpy        read_MBps / memcpy_MBps
Payload bytes are token ids (int32) + log-probs (float32) + loss mask (uint8).
Reads come from the OS page cache (the unit was just written), as a consumer
reading rollouts that finished moments ago would; `--payload_checksum` repeats
the reads with crc32c on every chunk.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from tqdm import tqdm

from knittrans_jax.storage import StoreSchema, TrajectoryStore
from knittrans_jax.types import Trajectory

MiB = 2**20
BYTES_PER_TOKEN = 4 + 4 + 1


def _batch(rng, first_group, k=16, tokens=2048):
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


def _timeit(fn, reps):
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def bench(root: str, mib: int, reps: int, micro_reps: int, checksum: bool, seed: int = 0) -> dict:
  schema = StoreSchema(sources=("math",), payload_checksum=checksum)
  url = "file://" + root
  store = TrajectoryStore.create(url, schema)
  writer = store.writer("bench")
  rng = np.random.default_rng(seed)
  target = mib * MiB
  batches, written = [], 0
  while written < target:  # generate first: the write timing excludes it
    b = _batch(rng, len(batches) * 2)
    batches.append(b)
    written += sum(t.prompt_tokens.size + t.response_tokens.size for t in b) * BYTES_PER_TOKEN
  t0 = time.perf_counter()
  for b in tqdm(batches, desc=f"append (checksum={checksum})", leave=False):
    writer.append(b)
  write_s = time.perf_counter() - t0

  metas = TrajectoryStore.open(url).list_committed("bench")
  nbytes = sum(m.length for m in metas) * BYTES_PER_TOKEN
  reader = TrajectoryStore.open(url)
  reader.read(metas[:16]).result()  # open arrays once; not part of the timing

  os.sync()  # let writeback of the appended pages finish before timing reads
  payload = reader.read(metas).result()
  # The same bytes, as contiguous arrays (what the sequential read moved).
  flat = [np.concatenate(payload.tokens), np.concatenate(payload.logprobs),
          np.concatenate(payload.loss_mask)]
  assert sum(a.nbytes for a in flat) == nbytes
  dst = [np.empty_like(a) for a in flat]
  # Interleaved, so that machine noise hits the read and the copies alike.
  read_times, copy_times, prealloc_times = [], [], []
  for _ in range(reps):
    read_times += _timeit(lambda: reader.read(metas).result(), 1)
    copy_times += _timeit(lambda: [a.copy() for a in flat], 1)
    prealloc_times += _timeit(lambda: [np.copyto(d, a) for d, a in zip(dst, flat)], 1)

  micro_bytes, micro_s = 0, 0.0
  for _ in range(micro_reps):
    pick = [metas[i] for i in rng.choice(len(metas), 16, replace=False)]
    t0 = time.perf_counter()
    reader.read(pick).result()
    micro_s += time.perf_counter() - t0
    micro_bytes += sum(m.length for m in pick) * BYTES_PER_TOKEN


  mbps = lambda b, times: b / MiB / statistics.median(times)
  result = {
      "payload_MiB": nbytes / MiB, "trajectories": len(metas), "payload_checksum": checksum,
      "write_MBps": nbytes / MiB / write_s,
      "read_MBps": mbps(nbytes, read_times),
      "read_MBps_best": nbytes / MiB / min(read_times),
      "microbatch_read_MBps": micro_bytes / MiB / micro_s,
      "microbatch_read_ms": 1e3 * micro_s / micro_reps,
      "memcpy_MBps": mbps(nbytes, copy_times),
      "memcpy_prealloc_MBps": mbps(nbytes, prealloc_times),
  }
  result["read_vs_memcpy"] = result["read_MBps"] / result["memcpy_MBps"]
  result["read_vs_memcpy_prealloc"] = result["read_MBps"] / result["memcpy_prealloc_MBps"]
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True, help="where to write the results")
  parser.add_argument("--mib", type=int, default=64, help="payload size of the unit")
  parser.add_argument("--reps", type=int, default=10,
                      help="interleaved repetitions of the read and the copies (medians reported)")
  parser.add_argument("--micro_reps", type=int, default=200)
  parser.add_argument("--dir", default=None, help="directory for the store (default: a temp dir)")
  parser.add_argument("--payload_checksum", action="store_true",
                      help="also measure with crc32c on payload chunks")
  args = parser.parse_args()

  base = args.dir or tempfile.mkdtemp(prefix="bench_store_")
  results = {}
  try:
    for checksum in ([False, True] if args.payload_checksum else [False]):
      root = os.path.join(base, f"store_checksum{int(checksum)}")
      shutil.rmtree(root, ignore_errors=True)
      results["checksum" if checksum else "default"] = bench(
          os.path.abspath(root), args.mib, args.reps, args.micro_reps, checksum)
  finally:
    if args.dir is None:
      shutil.rmtree(base, ignore_errors=True)
  out = dict(results["default"])
  out["cpu_count"] = os.cpu_count()
  if "checksum" in results:
    out["with_payload_checksum"] = results["checksum"]
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)

  print(f"\ntrajectory store, {out['payload_MiB']:.0f} MiB payload, {out['trajectories']} "
        f"trajectories, file:// on this machine ({out['cpu_count']} cores)")
  rows = [("append", "write_MBps"), ("sequential read", "read_MBps"),
          ("micro-batch read (16 traj)", "microbatch_read_MBps"),
          ("numpy copy (fresh dst)", "memcpy_MBps"), ("numpy copy (prealloc dst)", "memcpy_prealloc_MBps")]
  cols = [("default", results["default"])] + ([("crc32c", results["checksum"])]
                                                if "checksum" in results else [])
  print(f"  {'':<28}" + "".join(f"{name:>12}" for name, _ in cols) + "  (MB/s)")
  for label, key in rows:
    print(f"  {label:<28}" + "".join(f"{r[key]:>12.0f}" for _, r in cols))
  print(f"  {'read / memcpy':<28}" + "".join(f"{r['read_vs_memcpy']:>12.2f}" for _, r in cols))
  print(f"  {'read / memcpy (prealloc)':<28}"
        + "".join(f"{r['read_vs_memcpy_prealloc']:>12.2f}" for _, r in cols))
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
