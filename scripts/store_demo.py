"""Store demo (the default `make run` until the training job lands).

Starts several producer processes that append groups of trajectories to their own
storage units while this process polls the store for committed metadata, then reads
every trajectory back in micro-batches, checks it against what was written, and
prints write and read throughput.

  python scripts/store_demo.py --gin_file configs/store_demo.gin --workdir runs/demo
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import time

import gin
import numpy as np
from tqdm import tqdm

from knittrans_jax import cli, gin_cli
from knittrans_jax.storage import StoreSchema, TrajectoryStore
from knittrans_jax.storage.synthetic import random_group


def _groups(seed: int, unit_index: int, groups: int, group_size: int, sources, **kw):
  rng = np.random.default_rng([seed, unit_index])
  for g in range(groups):
    gid = unit_index * 1_000_000 + g
    yield random_group(rng, gid, group_size, sources[g % len(sources)], **kw)


def _producer(url: str, unit_index: int, groups: int, group_size: int, seed: int, kw):
  store = TrajectoryStore.open(url)
  writer = store.writer(f"producer{unit_index}")
  for group in _groups(seed, unit_index, groups, group_size, store.schema.sources, **kw):
    writer.append(group)


@gin.configurable
def store_demo(workdir: str, store_url: str | None = None, producers: int = 4,
               groups_per_producer: int = 64, group_size: int = 8,
               micro_batch: int = 16, seed: int = 0, prompt_len: int = 128,
               response_len_median: int = 512, max_response_len: int = 4096) -> dict:
  store_url = store_url or "file://" + os.path.abspath(os.path.join(workdir, "store"))
  if store_url.startswith("file://"):
    shutil.rmtree(store_url[len("file://"):], ignore_errors=True)
  schema = StoreSchema()
  store = TrajectoryStore.create(store_url, schema)
  kw = dict(prompt_len=prompt_len, response_len_median=response_len_median,
            max_response_len=max_response_len)
  total = producers * groups_per_producer * group_size

  ctx = mp.get_context("spawn")  # fresh interpreters: no inherited TensorStore threads
  procs = [ctx.Process(target=_producer, args=(store_url, p, groups_per_producer, group_size,
                                               seed, kw)) for p in range(producers)]
  watcher, metas = store.watch(), []
  t0 = time.perf_counter()
  for p in procs:
    p.start()
  with tqdm(total=total, desc="committed trajectories", unit="traj") as bar:
    while len(metas) < total:
      new = watcher.poll()
      metas += new
      bar.update(len(new))
      if not new:
        if any(p.exitcode not in (None, 0) for p in procs):
          raise RuntimeError(f"a producer failed: {[p.exitcode for p in procs]}")
        time.sleep(0.02)
  for p in procs:
    p.join()
  write_s = time.perf_counter() - t0

  # Read back in micro-batches and verify against the deterministic generator.
  expected = {}
  for u in range(producers):
    for group in _groups(seed, u, groups_per_producer, group_size, schema.sources, **kw):
      for t in group:
        expected[(t.group_id, t.index_in_group)] = t
  order = np.random.default_rng(seed).permutation(len(metas))
  nbytes, t0 = 0, time.perf_counter()
  pending = store.read([metas[i] for i in order[:micro_batch]])
  for start in tqdm(range(0, len(order), micro_batch), desc="reading micro-batches"):
    payload = pending.result()
    nxt = order[start + micro_batch:start + 2 * micro_batch]
    if len(nxt):
      pending = store.read([metas[i] for i in nxt])  # prefetch the next one
    nbytes += payload.nbytes
    for m, toks in zip(payload.metas, payload.tokens):
      t = expected[(m.group_id, m.index_in_group)]
      if not np.array_equal(toks, np.concatenate([t.prompt_tokens, t.response_tokens])):
        raise AssertionError(f"trajectory {m.id} read back wrong")
  read_s = time.perf_counter() - t0

  summary = {
      "store_url": store_url, "producers": producers, "trajectories": len(metas),
      "tokens": int(sum(m.length for m in metas)), "payload_MB": nbytes / 2**20,
      "write_s": write_s, "write_traj_per_s": len(metas) / write_s,
      "read_s": read_s, "read_MBps": nbytes / 2**20 / read_s, "verified": True,
  }
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print()
  for k, v in summary.items():
    print(f"  {k:<18} {v:.2f}" if isinstance(v, float) else f"  {k:<18} {v}")
  return summary


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_flags(parser, workdir_default="runs/store_demo")
  args = parser.parse_args()
  cli.parse(args)
  if cli.check_only(args):
    return
  store_demo(workdir=args.workdir)
  gin_cli.save_operative_config(args.workdir)


if __name__ == "__main__":
  main()
