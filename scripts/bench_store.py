"""Trajectory store benchmark: append, sequential read, micro-batch read, vs memcpy;
then the image path in both image layouts, side by side.

  python scripts/bench_store.py --json runs/bench_store.json [--mib 64] [--dir DIR] [--s3]
  python scripts/bench_store.py --json runs/bench_store_steady.json --steady_state

Everything is measured in this one run on the same bytes:
  write_MBps            appends of 16 trajectories (~2k tokens each) to one unit
  npsave_MBps           np.save of each append's payload arrays (its tokens,
                        log-probs and loss mask, one .npy file each) into a
                        directory beside the store (same filesystem), alternated
                        with the appends in blocks so that noise hits both alike
  append_vs_npsave      write_MBps / npsave_MBps (for s3, np.save goes to local disk)
  write_amplification   bytes the appends wrote (write system calls of this
                        process, /proc/self/io wchar) over the payload bytes: an
                        append rewrites each array's boundary chunk from its start
  npsave_whole_MBps     np.save of the whole payload as three arrays (beside it;
                        append_vs_npsave_whole = write_MBps / npsave_whole_MBps)
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

images.{dedup,no_dedup}: --image_groups groups of --image_n trajectories (320
tokens each) sharing one float32 image of --image_shape (448 x 448 x 3 = 2.4 MB),
in a store with StoreSchema.dedup_images True (the image stored once per group)
and False (a copy per trajectory: the equal-bytes layout):
  put_s                 the producer's path for all groups: Image.of (the one hash
                        of the image) and one append of the group with its image
  read_s                one read of --read_trajectories consecutive trajectories
                        (median of --image_reps reps of each such slice)
  read_moved_MB         bytes that read moved (sequences + every image copy)
  image_bytes_on_disk   size of the unit's image data files
  image_copies          rows of the image table

append_MBps_by_unit_size (with --growth_gb > 0): appends of --image_groups groups
of --image_n trajectories, each with its own copy of a float32 image of
--image_shape (StoreSchema(dedup_images=False), the equal-bytes layout), to one
long-lived unit on --growth_dir (/dev/shm by default) until its image data reaches
--growth_gb GB, as a rollout worker appends all run long. Each step of
--growth_step_gb is timed, and so is the same number of bytes written as plain
1 MiB files (open, writev, rename) into a directory beside the unit, right after
it: the file system's own rate at that moment (plain_write_MBps), so a slowdown of
the machine (fresh tmpfs pages are costly to fault in on some VMs) is told apart
from one of the store (append_vs_plain per step).

steady_state (with --steady_state, which runs this alone): appends of 16
trajectories (~2k tokens each) to one unit (StoreSchema defaults, on --steady_dir,
/dev/shm by default) that keeps a live window of --steady_live_mib MiB, cycled
through --steady_cycles times that size: after each append every chunk file of
the unit wholly below the window is reclaimed (storage/retention.py: the watermark
raised to the window's first row, TrajectoryStore.retain_from, then
UnitWriter.reclaim, as a job does): `sequences` and `images/data` files go to their
arrays' free pools, where the writer takes the files for its new chunks. np.save of the
same appends' payload arrays (one .npy file each, into a directory beside the
store, the files of appends that left the window deleted) and a numpy copy of the
same bytes into preallocated arrays alternate with the appends in blocks.
  append_MBps, npsave_MBps, memcpy_MBps   the appends, the np.saves, the copies
                        (reclamation and deletion are timed apart, not in these:
                        reclaim_ms_per_append, npsave_delete_ms_per_append)
  append_vs_npsave, append_vs_memcpy      append_MBps over the other two
  footprint_bytes       bytes the store's files hold on disk (st_blocks), sampled
                        after each cycle; npsave_footprint_bytes the same for the
                        np.save directory
  footprint_flat        max / min of footprint_bytes after the first cycle
  chunk_files_released  chunk files reclaimed (the large ones into the free pools)

s3 (with --s3): the same append and reads with the store on s3://, against a local
moto S3 server started on loopback for the run (knittrans_jax/testing/s3_server.py),
beside the file:// figures above; s3_vs_file_* are the ratios. moto is a Python
server: these are its throughput and per-request cost, not those of S3.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from tqdm import tqdm

import knittrans_jax
from knittrans_jax import cli
from knittrans_jax.storage import Image, StoreSchema, TrajectoryStore
from knittrans_jax.testing.s3_server import start_s3_server
from knittrans_jax.types import Trajectory

# The package measured. A script run from another checkout imports the editable
# install's package, not that checkout's, unless PYTHONPATH names the checkout:
# comparing two commits needs `PYTHONPATH=COPY python COPY/scripts/bench_store.py`.
PACKAGE_DIR = os.path.dirname(os.path.abspath(knittrans_jax.__file__))

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


def _image_group(rng, group_id, n, prompt=64, response=256):
  """n trajectories of one prompt (their image ids are set by the caller)."""
  tokens = rng.integers(0, 32000, prompt, dtype=np.int32)
  return [Trajectory(prompt_tokens=tokens,
                     response_tokens=rng.integers(0, 32000, response, dtype=np.int32),
                     logprobs=-rng.random(response, dtype=np.float32),
                     loss_mask=np.ones(response, bool), reward=float(rng.random()), source="math",
                     group_id=group_id, index_in_group=i, versions=(0,)) for i in range(n)]


def _written() -> int | None:
  """Bytes this process has passed to write system calls (None where not counted)."""
  try:
    with open("/proc/self/io") as f:
      return int(next(line for line in f if line.startswith("wchar:")).split()[1])
  except (OSError, StopIteration):
    return None


def _timeit(fn, reps):
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def bench(url: str, mib: int, reps: int, micro_reps: int, checksum: bool, npy_dir: str,
          seed: int = 0) -> dict:
  """`npy_dir`: where np.save writes the same payload (beside a file:// store)."""
  schema = StoreSchema(sources=("math",), payload_checksum=checksum)
  store = TrajectoryStore.create(url, schema)
  writer = store.writer("bench")
  rng = np.random.default_rng(seed)
  target = mib * MiB
  batches, written = [], 0
  while written < target:  # generate first: the write timing excludes it
    b = _batch(rng, len(batches) * 2)
    batches.append(b)
    written += sum(t.prompt_tokens.size + t.response_tokens.size for t in b) * BYTES_PER_TOKEN
  # The same payload arrays np.save writes, made before any timing.
  arrays = [[np.concatenate([np.concatenate([t.prompt_tokens, t.response_tokens]) for t in b]),
             np.concatenate([np.concatenate([np.zeros(t.prompt_tokens.size, np.float32),
                                             t.logprobs]) for t in b]),
             np.concatenate([np.concatenate([np.zeros(t.prompt_tokens.size, np.uint8),
                                             t.loss_mask.astype(np.uint8)]) for t in b])]
            for b in batches]
  assert sum(a.nbytes for arrs in arrays for a in arrs) == written
  os.makedirs(npy_dir)
  write_s = npsave_s = 0.0
  wchar = 0  # bytes the appends wrote
  blocks = 8  # appends and np.save alternate, block by block
  bar = tqdm(total=len(batches), desc=f"append (checksum={checksum})", leave=False)
  for blk in range(blocks):
    lo, hi = blk * len(batches) // blocks, (blk + 1) * len(batches) // blocks
    w0, t0 = _written(), time.perf_counter()
    for b in batches[lo:hi]:
      writer.append(b)
    write_s += time.perf_counter() - t0
    wchar = None if w0 is None or wchar is None else wchar + _written() - w0
    t0 = time.perf_counter()
    for k in range(lo, hi):
      for name, a in zip(("tokens", "logprobs", "loss_mask"), arrays[k]):
        np.save(os.path.join(npy_dir, f"{name}_{k}.npy"), a)
    npsave_s += time.perf_counter() - t0
    bar.update(hi - lo)
  bar.close()
  whole = [np.concatenate(col) for col in zip(*arrays)]
  t0 = time.perf_counter()
  for name, a in zip(("tokens", "logprobs", "loss_mask"), whole):
    np.save(os.path.join(npy_dir, f"{name}_whole.npy"), a)
  npsave_whole_s = time.perf_counter() - t0
  shutil.rmtree(npy_dir)
  del arrays

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
  # What was read is what was written, byte for byte (a benchmark that read the wrong
  # rows, or nothing, fails here, and its JSON says so).
  read_matches_written = all(np.array_equal(a, w) for a, w in zip(flat, whole))
  del whole
  dst = [np.empty_like(a) for a in flat]
  # Interleaved, so that machine noise hits the read and the copies alike.
  read_times, copy_times, prealloc_times, read_bytes = [], [], [], []

  def timed_read():
    read_bytes.append(reader.read(metas).result().nbytes)  # what each timed read returned

  for _ in range(reps):
    read_times += _timeit(timed_read, 1)
    copy_times += _timeit(lambda: [a.copy() for a in flat], 1)
    prealloc_times += _timeit(lambda: [np.copyto(d, a) for d, a in zip(dst, flat)], 1)

  micro_bytes, micro_s, micro_returned = 0, 0.0, 0
  for _ in range(micro_reps):
    pick = [metas[i] for i in rng.choice(len(metas), 16, replace=False)]
    t0 = time.perf_counter()
    got = reader.read(pick).result()
    micro_s += time.perf_counter() - t0
    micro_bytes += sum(m.length for m in pick) * BYTES_PER_TOKEN
    micro_returned += got.nbytes


  mbps = lambda b, times: b / MiB / statistics.median(times)
  result = {
      "payload_MiB": nbytes / MiB, "trajectories": len(metas), "payload_checksum": checksum,
      "payload_bytes": nbytes, "read_matches_written": read_matches_written,
      # Bytes the timed reads returned (each rep, and the micro-batch reads' sum): the
      # rates below divide the bytes asked for, so these must equal them.
      "read_bytes_returned": read_bytes, "microbatch_bytes": micro_bytes,
      "microbatch_bytes_returned": micro_returned,
      "read_s": statistics.median(read_times), "memcpy_s": statistics.median(copy_times),
      "write_MBps": nbytes / MiB / write_s,
      "npsave_MBps": nbytes / MiB / npsave_s,
      "npsave_whole_MBps": nbytes / MiB / npsave_whole_s,
      # Only a file store's writes are write system calls (s3's go out as sends).
      "write_amplification": (wchar / nbytes if wchar is not None and url.startswith("file://")
                              else None),
      "read_MBps": mbps(nbytes, read_times),
      "read_MBps_best": nbytes / MiB / min(read_times),
      "microbatch_read_MBps": micro_bytes / MiB / micro_s,
      "microbatch_read_ms": 1e3 * micro_s / micro_reps,
      "memcpy_MBps": mbps(nbytes, copy_times),
      "memcpy_prealloc_MBps": mbps(nbytes, prealloc_times),
  }
  result["append_vs_npsave"] = result["write_MBps"] / result["npsave_MBps"]
  result["append_vs_npsave_whole"] = result["write_MBps"] / result["npsave_whole_MBps"]
  result["read_vs_memcpy"] = result["read_MBps"] / result["memcpy_MBps"]
  result["read_vs_memcpy_prealloc"] = result["read_MBps"] / result["memcpy_prealloc_MBps"]
  return result


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def bench_images(root: str, dedup: bool, groups: int, n: int, shape: tuple[int, ...],
                 read_trajectories: int, reps: int, seed: int = 0) -> dict:
  """The image path in one layout: put every group with its image, then read slices."""
  url = "file://" + root
  store = TrajectoryStore.create(url, StoreSchema(sources=("math",), dedup_images=dedup))
  writer = store.writer("vlm")
  rng = np.random.default_rng(seed)
  arrays = [rng.random(shape, dtype=np.float32) for _ in range(groups)]
  groups_ = [_image_group(rng, g, n) for g in range(groups)]
  array_of = {}
  t0 = time.perf_counter()
  for array, group in zip(arrays, groups_):
    image = Image.of(array)  # the producer's one hash of its image
    writer.append([dataclasses.replace(t, image_ids=(image.id,)) for t in group], images=[image])
    array_of[image.id] = array
  put_s = time.perf_counter() - t0

  reader = TrajectoryStore.open(url)
  metas = reader.list_committed("vlm")
  k = min(read_trajectories, len(metas))
  slices = [metas[i:i + k] for i in range(0, len(metas) - k + 1, k)]
  first = reader.read(slices[0]).result()  # opens the arrays; checked, not timed
  for iid, image in first.images.items():
    np.testing.assert_array_equal(image, array_of[iid])
  os.sync()
  read_times = []
  for _ in range(reps):
    for sl in slices:
      read_times += _timeit(lambda: reader.read(sl).result(), 1)
  moved = first.nbytes_read
  image_dir = os.path.join(root, "vlm", "images", "data")
  return {"dedup_images": dedup, "put_s": put_s, "put_s_per_group": put_s / groups,
          "read_trajectories": k, "read_s": statistics.median(read_times),
          "read_moved_MB": moved / 1e6, "read_MBps": moved / 1e6 / statistics.median(read_times),
          "image_bytes_on_disk": _dir_bytes(image_dir),
          "store_bytes_on_disk": _dir_bytes(root),
          "image_copies": store.reader("vlm").commit().images}


def _plain_writes(directory: str, nbytes: int, first: int) -> float:
  """Seconds to write `nbytes` as fresh 1 MiB files (open, writev, rename), as the
  store writes a chunk: the file system's rate, for comparison."""
  os.makedirs(directory, exist_ok=True)
  buf = np.frombuffer(np.random.default_rng(first).bytes(MiB), np.uint8)
  t0 = time.perf_counter()
  for k in range(first, first + -(-nbytes // MiB)):
    tmp = os.path.join(directory, f".tmp{k}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      os.writev(fd, [buf])
    finally:
      os.close(fd)
    os.rename(tmp, os.path.join(directory, str(k)))
  return time.perf_counter() - t0


def bench_append_growth(root: str, total_gb: float, step_gb: float, groups: int, n: int,
                        shape: tuple[int, ...], seed: int = 0) -> list[dict]:
  """The append rate of one unit as it grows, step by step, beside plain writes."""
  url = "file://" + root
  store = TrajectoryStore.create(url, StoreSchema(sources=("math",), dedup_images=False))
  writer = store.writer("vlm")
  rng = np.random.default_rng(seed)
  arrays = [rng.random(shape, dtype=np.float32) for _ in range(groups)]
  images = [Image.of(a) for a in arrays]
  steps, group_id, plain_files = [], 0, 0
  total, step = int(total_gb * 1e9), int(step_gb * 1e9)
  with tqdm(total=total, unit="B", unit_scale=True, desc="append growth") as bar:
    while writer.commit.image_bytes < total:
      start = writer.commit.image_bytes
      t0 = time.perf_counter()
      while writer.commit.image_bytes - start < step:
        g = group_id % groups
        group = _image_group(rng, group_id, n)
        writer.append([dataclasses.replace(t, image_ids=(images[g].id,)) for t in group],
                      images=[images[g]])
        group_id += 1
      append_s = time.perf_counter() - t0
      written = writer.commit.image_bytes - start
      plain_s = _plain_writes(root + "_plain", written, plain_files)
      plain_files += -(-written // MiB)
      mb = written / 1e6
      steps.append({"unit_GB": writer.commit.image_bytes / 1e9, "MB": mb,
                    "append_MBps": mb / append_s, "plain_write_MBps": mb / plain_s,
                    "append_vs_plain": plain_s / append_s})
      bar.update(written)
  shutil.rmtree(root, ignore_errors=True)
  shutil.rmtree(root + "_plain", ignore_errors=True)
  return steps


def _disk_bytes(path: str) -> int:
  """Bytes the files under `path` hold on disk (allocated blocks, not their sizes)."""
  return sum(os.stat(os.path.join(d, f)).st_blocks * 512
             for d, _, files in os.walk(path) for f in files)


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
    b = _batch(rng, len(batches) * 2)
    arrs = [np.concatenate([np.concatenate([t.prompt_tokens, t.response_tokens]) for t in b]),
            np.concatenate([np.concatenate([np.zeros(t.prompt_tokens.size, np.float32),
                                            t.logprobs]) for t in b]),
            np.concatenate([np.concatenate([np.zeros(t.prompt_tokens.size, np.uint8),
                                            t.loss_mask.astype(np.uint8)]) for t in b])]
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
        footprint.append(_disk_bytes(os.path.join(root, "store")))
        npsave_footprint.append(_disk_bytes(npy_dir))
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
  parser.add_argument("--image_groups", type=int, default=32)
  parser.add_argument("--image_n", type=int, default=8, help="trajectories per group")
  parser.add_argument("--image_shape", default="448,448,3", help="float32 image shape")
  parser.add_argument("--read_trajectories", type=int, default=128)
  parser.add_argument("--image_reps", type=int, default=5)
  parser.add_argument("--growth_gb", type=float, default=0.0,
                      help="also grow one unit to this many GB of images (0: skip)")
  parser.add_argument("--growth_step_gb", type=float, default=0.5)
  parser.add_argument("--growth_dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                      help="where the growing unit goes (default /dev/shm)")
  parser.add_argument("--steady_state", action="store_true",
                      help="run only the steady-state appends (a live window, the rest "
                           "reclaimed into free pools) and write their figures")
  parser.add_argument("--steady_live_mib", type=int, default=64,
                      help="the live window of the steady-state unit")
  parser.add_argument("--steady_cycles", type=int, default=10,
                      help="appends cycle through this many times the live window")
  parser.add_argument("--steady_dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                      help="where the steady-state unit goes (default /dev/shm)")
  parser.add_argument("--s3", action="store_true",
                      help="also run the append and reads on s3:// (a local moto server)")
  cli.add_check_flag(parser)
  args = parser.parse_args()
  shape = tuple(int(d) for d in args.image_shape.split(","))
  if cli.check_only(args):
    return

  if args.steady_state:
    _main_steady_state(args)
    return
  base = args.dir or tempfile.mkdtemp(prefix="bench_store_")
  results = {}
  try:
    for checksum in ([False, True] if args.payload_checksum else [False]):
      root = os.path.join(base, f"store_checksum{int(checksum)}")
      shutil.rmtree(root, ignore_errors=True)
      results["checksum" if checksum else "default"] = bench(
          "file://" + os.path.abspath(root), args.mib, args.reps, args.micro_reps, checksum,
          os.path.abspath(root) + "_npsave")
    if args.s3:
      with start_s3_server() as server:
        server.create_bucket("bench-store")
        os.environ.update(server.env)
        results["s3"] = bench("s3://bench-store/store", args.mib, args.reps, args.micro_reps,
                              False, os.path.join(os.path.abspath(base), "s3_npsave"))
    images = {"groups": args.image_groups, "n": args.image_n, "image_shape": list(shape),
              "image_MB": 4 * np.prod(shape) / 1e6}
    for name, dedup in (("dedup", True), ("no_dedup", False)):
      root = os.path.join(base, f"images_{name}")
      shutil.rmtree(root, ignore_errors=True)
      images[name] = bench_images(os.path.abspath(root), dedup, args.image_groups, args.image_n,
                                  shape, args.read_trajectories, args.image_reps)
      shutil.rmtree(root, ignore_errors=True)
    for key in ("image_bytes_on_disk", "put_s", "read_s", "read_moved_MB"):
      images[f"no_dedup_vs_dedup_{key}"] = images["no_dedup"][key] / images["dedup"][key]
    growth = None
    if args.growth_gb > 0:
      root = tempfile.mkdtemp(prefix="bench_store_growth_", dir=args.growth_dir or base)
      growth = bench_append_growth(os.path.join(root, "store"), args.growth_gb,
                                   args.growth_step_gb, args.image_groups, args.image_n, shape)
      shutil.rmtree(root, ignore_errors=True)
  finally:
    if args.dir is None:
      shutil.rmtree(base, ignore_errors=True)
  out = dict(results["default"])
  out["cpu_count"] = os.cpu_count()
  out["package_dir"] = PACKAGE_DIR
  if "checksum" in results:
    out["with_payload_checksum"] = results["checksum"]
  if "s3" in results:
    out["s3"] = results["s3"]
    for key in ("write_MBps", "read_MBps", "microbatch_read_MBps"):
      out[f"s3_vs_file_{key}"] = results["s3"][key] / out[key]
  out["images"] = images
  if growth is not None:
    out["append_MBps_by_unit_size"] = growth
    out["append_growth_dir"] = args.growth_dir or base
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)

  print(f"\ntrajectory store, {out['payload_MiB']:.0f} MiB payload, {out['trajectories']} "
        f"trajectories, file:// on this machine ({out['cpu_count']} cores)"
        + (", s3:// on a local moto server" if "s3" in results else ""))
  rows = [("append", "write_MBps"), ("np.save per append", "npsave_MBps"),
          ("np.save whole payload", "npsave_whole_MBps"), ("sequential read", "read_MBps"),
          ("micro-batch read (16 traj)", "microbatch_read_MBps"),
          ("numpy copy (fresh dst)", "memcpy_MBps"), ("numpy copy (prealloc dst)", "memcpy_prealloc_MBps")]
  cols = [("default", results["default"])] + ([("crc32c", results["checksum"])]
                                                if "checksum" in results else [])
  cols += [("s3 (moto)", results["s3"])] if "s3" in results else []
  print(f"  {'':<28}" + "".join(f"{name:>12}" for name, _ in cols) + "  (MB/s)")
  for label, key in rows:
    print(f"  {label:<28}" + "".join(f"{r[key]:>12.0f}" for _, r in cols))
  print(f"  {'append / np.save':<28}" + "".join(f"{r['append_vs_npsave']:>12.2f}" for _, r in cols))
  print(f"  {'bytes written / payload':<28}"
        + "".join(f"{r['write_amplification'] or float('nan'):>12.2f}" for _, r in cols))
  print(f"  {'append / np.save (whole)':<28}"
        + "".join(f"{r['append_vs_npsave_whole']:>12.2f}" for _, r in cols))
  if growth is not None:
    print(f"\none unit growing to {args.growth_gb:g} GB of images on {out['append_growth_dir']} "
          f"(no dedup), per {args.growth_step_gb:g} GB step:")
    print(f"  {'unit GB':>8}{'append MB/s':>13}{'plain MB/s':>12}{'append/plain':>14}")
    for r in growth:
      print(f"  {r['unit_GB']:>8.2f}{r['append_MBps']:>13.0f}{r['plain_write_MBps']:>12.0f}"
            f"{r['append_vs_plain']:>14.2f}")
  print(f"  {'read / memcpy':<28}" + "".join(f"{r['read_vs_memcpy']:>12.2f}" for _, r in cols))
  print(f"  {'read / memcpy (prealloc)':<28}"
        + "".join(f"{r['read_vs_memcpy_prealloc']:>12.2f}" for _, r in cols))
  print(f"\nimage path: {images['groups']} groups x {images['n']} trajectories, one "
        f"{images['image_MB']:.1f} MB image per group")
  print(f"  {'':<28}{'dedup':>12}{'no_dedup':>12}{'ratio':>8}")
  for label, key, fmt in (("put, all groups (s)", "put_s", ".3f"),
                          (f"read {images['dedup']['read_trajectories']} traj (s)", "read_s", ".3f"),
                          ("read moved (MB)", "read_moved_MB", ".1f"),
                          ("image bytes on disk (MB)", "image_bytes_on_disk", ".1f")):
    a, b = images["dedup"][key], images["no_dedup"][key]
    scale = 1e-6 if key == "image_bytes_on_disk" else 1
    print(f"  {label:<28}{a * scale:>12{fmt}}{b * scale:>12{fmt}}{b / a:>8.2f}")
  print(f"wrote {args.json}")


def _main_steady_state(args) -> None:
  root = tempfile.mkdtemp(prefix="bench_store_steady_", dir=args.steady_dir)
  try:
    steady = bench_steady_state(root, args.steady_live_mib, args.steady_cycles)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  out = {"cpu_count": os.cpu_count(), "package_dir": PACKAGE_DIR, "steady_state": steady}
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  s = steady
  print(f"\nsteady state: one unit on {args.steady_dir}, {s['live_MiB']:.0f} MiB live "
        f"({s['appends_per_cycle']} appends), {s['cycles']} cycles, {s['appended_MiB']:.0f} "
        f"MiB appended ({out['cpu_count']} cores)")
  print(f"  append {s['append_MBps']:.0f} MB/s, np.save {s['npsave_MBps']:.0f} MB/s, numpy copy "
        f"{s['memcpy_MBps']:.0f} MB/s: append / np.save {s['append_vs_npsave']:.2f}, "
        f"append / copy {s['append_vs_memcpy']:.3f}")
  print(f"  reclaim {s['reclaim_ms_per_append']:.3f} ms per append "
        f"({s['chunk_files_released']} chunk files), np.save deletes "
        f"{s['npsave_delete_ms_per_append']:.3f} ms")
  print(f"  footprint after each cycle (MB): "
        + " ".join(f"{b / 1e6:.1f}" for b in s["footprint_bytes"])
        + f"; flat {s['footprint_flat']:.3f} (max / min after the first)")
  print(f"  read of the last half window matches what was written: {s['read_matches_written']}")
  print(f"  store code: {PACKAGE_DIR}")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
