"""Fault injection report: every scenario of knittrans_jax/faults/, repeated with
random timing, and what survived.

  python scripts/fault_report.py --json runs/fault_report.json          # full counts
  python scripts/fault_report.py --json runs/fault_report.json --quick  # fewer trials
  python scripts/fault_report.py --json runs/fault_report_s3.json --store s3  # a local moto server
  python scripts/fault_report.py --json out.json --store s3://bucket/prefix  # an S3 you name

--store picks the backend: file (the default: stores under a local directory), s3
(starts its own moto S3 server on loopback) or an s3:// URL (reached with the
standard AWS variables: AWS_ENDPOINT_URL_S3 for an S3-compatible server, credentials).
A full disk has no meaning on s3: there the s3_outage scenario (the server becomes
unreachable mid-append) stands in for disk_full.

Prints a table of scenario, trials, trajectories written, trained, lost (must be 0),
duplicated (must be 0) and quarantined (rows set aside as corrupt), and exits
non-zero if anything was lost or duplicated.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from knittrans_jax import cli  # noqa: E402
from knittrans_jax.faults import (concurrent_writers, corrupt_chunk, disk_full,  # noqa: E402
                                  reclaim_kill, s3_outage, trainer_kill, writer_kill)
from knittrans_jax.storage import layout as L  # noqa: E402
from knittrans_jax.testing.s3_server import start_s3_server  # noqa: E402

FULL = {"writer_kill": dict(trials=20), "trainer_kill": dict(trials=5),
        "corrupt_chunk": dict(trials=6), "disk_full": dict(trials=3),
        "s3_outage": dict(trials=3), "concurrent_writers": dict(writers=8, seconds=60.0),
        "reclaim_kill": dict(trials=20)}
QUICK = {"writer_kill": dict(trials=20), "trainer_kill": dict(trials=1),
         "corrupt_chunk": dict(trials=3), "disk_full": dict(trials=1),
         "s3_outage": dict(trials=1), "concurrent_writers": dict(writers=8, seconds=10.0),
         "reclaim_kill": dict(trials=5)}
RUNNERS = {"writer_kill": writer_kill.run, "trainer_kill": trainer_kill.run,
           "corrupt_chunk": corrupt_chunk.run, "disk_full": disk_full.run,
           "s3_outage": s3_outage.run, "concurrent_writers": concurrent_writers.run,
           "reclaim_kill": reclaim_kill.run}
ONLY_ON = {"disk_full": "file", "s3_outage": "s3"}  # scenarios that have one backend
REPORT_BUCKET = "fault-report"


@contextlib.contextmanager
def store_root(store: str):
  """Yields the URL the scenarios' stores go under (None: their local directories)."""
  if store == "file":
    yield None
  elif store == "s3":
    with start_s3_server() as server:
      server.create_bucket(REPORT_BUCKET)
      os.environ.update(server.env)  # the scenarios' writer and job processes inherit it
      yield f"s3://{REPORT_BUCKET}/"
  elif store.startswith("s3://"):
    yield store
  else:
    raise SystemExit(f"--store {store!r}: use file, s3 or an s3://bucket/prefix URL")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", required=True)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--only", nargs="*", choices=sorted(RUNNERS))
  parser.add_argument("--dir", default=None, help="keep the scenarios' work dirs here")
  parser.add_argument("--store", default="file", help="file, s3 or an s3:// URL (see above)")
  cli.add_check_flag(parser)
  args = parser.parse_args()
  if cli.check_only(args):
    return
  counts = QUICK if args.quick else FULL
  base = args.dir or tempfile.mkdtemp(prefix="fault_report_")
  backend = "file" if args.store == "file" else "s3"
  rows = []
  with store_root(args.store) as root_url:
    for name in args.only or list(RUNNERS):
      if ONLY_ON.get(name, backend) != backend:
        print(f"{name}: skipped on {backend} (runs on {ONLY_ON[name]} only)")
        continue
      t0 = time.perf_counter()
      print(f"{name} ...", flush=True)
      where = {"store_url": L.join(root_url, name)} if root_url else {}
      outcome = RUNNERS[name](os.path.join(base, name), **counts[name], **where)
      rows.append({**outcome.as_dict(), "wall_s": time.perf_counter() - t0, "name": name})
  if args.dir is None:
    shutil.rmtree(base, ignore_errors=True)
  print(f"\n{'scenario':<44}{'trials':>7}{'written':>9}{'trained':>9}{'lost':>6}{'dup':>5}"
        f"{'quar.':>7}{'s':>7}")
  for r in rows:
    print(f"{r['scenario'][:43]:<44}{r['trials']:>7}{r['written']:>9}{r['trained']:>9}"
          f"{r['lost']:>6}{r['duplicated']:>5}{r['quarantined']:>7}{r['wall_s']:>7.0f}")
  ok = all(r["lost"] == 0 and r["duplicated"] == 0 for r in rows)
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump({"quick": args.quick, "store": args.store, "scenarios": rows, "ok": ok}, f,
              indent=1)
  print(f"wrote {args.json}" + ("" if ok else "\nSOMETHING WAS LOST OR DUPLICATED"))
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
