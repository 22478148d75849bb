"""Child process for multi-process store tests: appends groups to one unit.

usage: store_writer_proc.py URL UNIT SEED FIRST_GROUP NUM_GROUPS GROUP_SIZE
Groups are appended one or two per call; prints 'done' when finished.
"""
import sys

from store_helpers import group

from knittrans_jax.storage import TrajectoryStore


def main():
  url, unit = sys.argv[1], sys.argv[2]
  seed, first, count, n = map(int, sys.argv[3:7])
  writer = TrajectoryStore.open(url).writer(unit)
  gid = first
  while gid < first + count:
    batch = group(seed, gid, n)
    if gid + 1 < first + count and gid % 3 == 0:  # vary the append size
      gid += 1
      batch += group(seed, gid, n)
    writer.append(batch)
    gid += 1
  print("done", flush=True)


if __name__ == "__main__":
  main()
