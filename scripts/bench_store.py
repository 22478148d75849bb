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
import json
import os
import shutil
import tempfile

import numpy as np

import knittrans_jax
from knittrans_jax import cli
from knittrans_jax.bench.store_rates import append_and_read, append_growth, image_layouts
from knittrans_jax.bench.store_steady_state import bench_steady_state
from knittrans_jax.testing.s3_server import start_s3_server

# The package measured. A script run from another checkout imports the editable
# install's package, not that checkout's, unless PYTHONPATH names the checkout:
# comparing two commits needs `PYTHONPATH=COPY python COPY/scripts/bench_store.py`.
PACKAGE_DIR = os.path.dirname(os.path.abspath(knittrans_jax.__file__))


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
      results["checksum" if checksum else "default"] = append_and_read(
          "file://" + os.path.abspath(root), args.mib, args.reps, args.micro_reps, checksum,
          os.path.abspath(root) + "_npsave")
    if args.s3:
      with start_s3_server() as server:
        server.create_bucket("bench-store")
        os.environ.update(server.env)
        results["s3"] = append_and_read("s3://bench-store/store", args.mib, args.reps, args.micro_reps,
                              False, os.path.join(os.path.abspath(base), "s3_npsave"))
    images = {"groups": args.image_groups, "n": args.image_n, "image_shape": list(shape),
              "image_MB": 4 * np.prod(shape) / 1e6}
    for name, dedup in (("dedup", True), ("no_dedup", False)):
      root = os.path.join(base, f"images_{name}")
      shutil.rmtree(root, ignore_errors=True)
      images[name] = image_layouts(os.path.abspath(root), dedup, args.image_groups, args.image_n,
                                  shape, args.read_trajectories, args.image_reps)
      shutil.rmtree(root, ignore_errors=True)
    for key in ("image_bytes_on_disk", "put_s", "read_s", "read_moved_MB"):
      images[f"no_dedup_vs_dedup_{key}"] = images["no_dedup"][key] / images["dedup"][key]
    growth = None
    if args.growth_gb > 0:
      root = tempfile.mkdtemp(prefix="bench_store_growth_", dir=args.growth_dir or base)
      growth = append_growth(os.path.join(root, "store"), args.growth_gb,
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
  print("  footprint after each cycle (MB): "
        + " ".join(f"{b / 1e6:.1f}" for b in s["footprint_bytes"])
        + f"; flat {s['footprint_flat']:.3f} (max / min after the first)")
  print(f"  read of the last half window matches what was written: {s['read_matches_written']}")
  print(f"  store code: {PACKAGE_DIR}")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
