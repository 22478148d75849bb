"""The trajectory store's rates beside plain writes and copies of the same bytes
(scripts/bench_store.py): appends and reads against np.save and a numpy copy, the image
path in both image layouts, and a unit's append rate as it grows."""
from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time

import numpy as np
from tqdm import tqdm

from knittrans_jax.bench.store_payloads import (BYTES_PER_TOKEN, MiB, dir_bytes, image_group,
                                                payload_arrays, text_batch, written_bytes)
from knittrans_jax.bench.timing import time_calls
from knittrans_jax.storage import Image, StoreSchema, TrajectoryStore


def append_and_read(url: str, mib: int, reps: int, micro_reps: int, checksum: bool, npy_dir: str,
          seed: int = 0) -> dict:
  """`npy_dir`: where np.save writes the same payload (beside a file:// store)."""
  schema = StoreSchema(sources=("math",), payload_checksum=checksum)
  store = TrajectoryStore.create(url, schema)
  writer = store.writer("bench")
  rng = np.random.default_rng(seed)
  target = mib * MiB
  batches, written = [], 0
  while written < target:  # generate first: the write timing excludes it
    b = text_batch(rng, len(batches) * 2)
    batches.append(b)
    written += sum(t.prompt_tokens.size + t.response_tokens.size for t in b) * BYTES_PER_TOKEN
  # The same payload arrays np.save writes, made before any timing.
  arrays = [payload_arrays(b) for b in batches]
  assert sum(a.nbytes for arrs in arrays for a in arrs) == written
  os.makedirs(npy_dir)
  write_s = npsave_s = 0.0
  wchar = 0  # bytes the appends wrote
  blocks = 8  # appends and np.save alternate, block by block
  bar = tqdm(total=len(batches), desc=f"append (checksum={checksum})", leave=False)
  for blk in range(blocks):
    lo, hi = blk * len(batches) // blocks, (blk + 1) * len(batches) // blocks
    w0, t0 = written_bytes(), time.perf_counter()
    for b in batches[lo:hi]:
      writer.append(b)
    write_s += time.perf_counter() - t0
    wchar = None if w0 is None or wchar is None else wchar + written_bytes() - w0
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
    read_times += time_calls(timed_read, 1)
    copy_times += time_calls(lambda: [a.copy() for a in flat], 1)
    prealloc_times += time_calls(lambda: [np.copyto(d, a) for d, a in zip(dst, flat)], 1)

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



def image_layouts(root: str, dedup: bool, groups: int, n: int, shape: tuple[int, ...],
                 read_trajectories: int, reps: int, seed: int = 0) -> dict:
  """The image path in one layout: put every group with its image, then read slices."""
  url = "file://" + root
  store = TrajectoryStore.create(url, StoreSchema(sources=("math",), dedup_images=dedup))
  writer = store.writer("vlm")
  rng = np.random.default_rng(seed)
  arrays = [rng.random(shape, dtype=np.float32) for _ in range(groups)]
  groups_ = [image_group(rng, g, n) for g in range(groups)]
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
      read_times += time_calls(lambda: reader.read(sl).result(), 1)
  moved = first.nbytes_read
  image_dir = os.path.join(root, "vlm", "images", "data")
  return {"dedup_images": dedup, "put_s": put_s, "put_s_per_group": put_s / groups,
          "read_trajectories": k, "read_s": statistics.median(read_times),
          "read_moved_MB": moved / 1e6, "read_MBps": moved / 1e6 / statistics.median(read_times),
          "image_bytes_on_disk": dir_bytes(image_dir),
          "store_bytes_on_disk": dir_bytes(root),
          "image_copies": store.reader("vlm").commit().images}


def plain_writes(directory: str, nbytes: int, first: int) -> float:
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


def append_growth(root: str, total_gb: float, step_gb: float, groups: int, n: int,
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
        group = image_group(rng, group_id, n)
        writer.append([dataclasses.replace(t, image_ids=(images[g].id,)) for t in group],
                      images=[images[g]])
        group_id += 1
      append_s = time.perf_counter() - t0
      written = writer.commit.image_bytes - start
      plain_s = plain_writes(root + "_plain", written, plain_files)
      plain_files += -(-written // MiB)
      mb = written / 1e6
      steps.append({"unit_GB": writer.commit.image_bytes / 1e9, "MB": mb,
                    "append_MBps": mb / append_s, "plain_write_MBps": mb / plain_s,
                    "append_vs_plain": plain_s / append_s})
      bar.update(written)
  shutil.rmtree(root, ignore_errors=True)
  shutil.rmtree(root + "_plain", ignore_errors=True)
  return steps

