"""Image hash throughput: blake2b-128, xxh3-128, BLAKE3, crc32 vs a memcpy, per image.

  python scripts/bench_image_hash.py --json runs/bench_image_hash.json [--mb 2.4] [--reps 200]

Each figure is the median over --reps interleaved repetitions on the same
--mb MB uint8 array (a 448 x 448 x 3 float32 image is 2.4 MB), one thread:
  blake2b_128   hashlib.blake2b(digest_size=16), the image id before issue 18
  xxh3_128      xxhash.xxh3_128 (non-cryptographic)
  blake3        blake3.blake3, 128-bit digest (cryptographic), one thread; left
                out when the blake3 package is not installed (not a requirement)
  crc32         zlib.crc32, for scale (a checksum, 32 bits)
  image_id      knittrans_jax.storage.image_id as it is now (dtype + shape + bytes)
  memcpy        numpy copy into a preallocated array (the scale of a read)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import zlib

import numpy as np
import xxhash

try:  # only this comparison uses it: pip install blake3==1.0.11
  import blake3
except ImportError:
  blake3 = None

from knittrans_jax.bench.timing import time_calls
from knittrans_jax.storage import image_id


def _median_s(fn, reps: int) -> float:
  return statistics.median(time_calls(fn, reps))


def bench(nbytes: int, reps: int, seed: int = 0) -> dict:
  data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
  view = memoryview(data)
  dst = np.empty_like(data)
  fns = {
      "blake2b_128": lambda: hashlib.blake2b(view, digest_size=16).digest(),
      "xxh3_128": lambda: xxhash.xxh3_128(view).digest(),
      "blake3": blake3 and (lambda: blake3.blake3(view).digest(16)),
      "crc32": lambda: zlib.crc32(view),
      "image_id": lambda: image_id(data),
      "memcpy": lambda: np.copyto(dst, data),
  }
  fns = {name: fn for name, fn in fns.items() if fn is not None}
  times = {name: [] for name in fns}
  for _ in range(reps):  # interleaved: machine noise hits every function alike
    for name, fn in fns.items():
      times[name].append(_median_s(fn, 1))
  # What each timed function produced, so a reader (and the test) can check that the
  # functions timed are the named ones, on these bytes: the image is rng(seed)'s.
  digests = {name: (fn().hex() if isinstance(fn(), bytes) else str(fn()))
             for name, fn in fns.items() if name != "memcpy"}
  out = {"image_MB": nbytes / 1e6, "reps": reps, "cpu_count": os.cpu_count(), "seed": seed,
         "digests": digests, "memcpy_equal": bool(np.array_equal(dst, data)),
         "MBps": {name: nbytes / 1e6 / statistics.median(t) for name, t in times.items()},
         "ms_per_image": {name: 1e3 * statistics.median(t) for name, t in times.items()}}
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True)
  parser.add_argument("--mb", type=float, default=2.4, help="image size in MB (10**6 bytes)")
  parser.add_argument("--reps", type=int, default=200)
  args = parser.parse_args()
  out = bench(int(args.mb * 1e6), args.reps)
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"\nimage hash, {out['image_MB']:.1f} MB uint8, one thread, median of {args.reps} "
        f"({out['cpu_count']} cores)")
  print(f"  {'':<14}{'MB/s':>10}{'ms/image':>10}")
  for name, mbps in out["MBps"].items():
    print(f"  {name:<14}{mbps:>10.0f}{out['ms_per_image'][name]:>10.3f}")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
