"""A writer process for fault scenarios: appends groups to one unit and prints
`ack GID` after each append has committed (so the parent knows what was promised).

  python -m knittrans_jax.faults.writer_proc URL UNIT SEED FIRST COUNT N [SECONDS]

Stops after COUNT groups, or after SECONDS if given (COUNT is then a cap).
"""
import sys
import time

from knittrans_jax.faults.data import group
from knittrans_jax.storage import TrajectoryStore


def main():
  url, unit = sys.argv[1], sys.argv[2]
  seed, first, count, n = map(int, sys.argv[3:7])
  seconds = float(sys.argv[7]) if len(sys.argv) > 7 else None
  writer = TrajectoryStore.open(url).writer(unit)
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
