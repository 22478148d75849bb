"""A writer process for fault scenarios: appends groups to one unit and prints
`ack GID` after each append has committed (so the parent knows what was promised).

  python -m knittrans_jax.faults.writer_proc URL UNIT SEED FIRST COUNT N [SECONDS]
      [--reclaim_every_s S]

Stops after COUNT groups, or after SECONDS if given (COUNT is then a cap).
--reclaim_every_s: how often an append first reclaims below the unit's low
watermark (UnitWriter; 0: before every append).
"""
import sys
import time

from knittrans_jax.faults.data import group
from knittrans_jax.storage import TrajectoryStore


def main():
  argv, options = sys.argv[1:], {}
  if "--reclaim_every_s" in argv:
    at = argv.index("--reclaim_every_s")
    options["reclaim_every_s"] = float(argv[at + 1])
    del argv[at:at + 2]
  url, unit = argv[0], argv[1]
  seed, first, count, n = map(int, argv[2:6])
  seconds = float(argv[6]) if len(argv) > 6 else None
  writer = TrajectoryStore.open(url).writer(unit, **options)
  t0 = time.time()
  gid = first
  while gid < first + count and (seconds is None or time.time() - t0 < seconds):
    ids = [gid]
    if gid + 1 < first + count and gid % 3 == 0:  # vary the append size
      ids.append(gid + 1)
    writer.append([t for g in ids for t in group(seed, g, n)])
    for g in ids:
      print(f"ack {g}", flush=True)
    gid = ids[-1] + 1
  print("done", flush=True)


if __name__ == "__main__":
  main()
