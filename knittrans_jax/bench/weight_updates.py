"""Seconds per weight update, from the trainer's arrays to an engine's, through the
job's WeightPublisher / WeightSubscriber, each beside numpy copies of the same bytes
(scripts/bench_rollout.py)."""
from __future__ import annotations

import time

import jax
import numpy as np
from tqdm import tqdm

from knittrans_jax.rollout.weight_subscriber import WeightSubscriber
from knittrans_jax.rollout.weights import WeightPublisher, WeightSyncConfig, wire_template


def _median(xs) -> float:
  return float(np.median(xs))


def weight_updates(engine, params, model_cfg, sync: WeightSyncConfig, updates: int,
                   workdir: str) -> dict:
  """`updates` versions of `params` (the trainer's device arrays) published on `sync`'s
  transport, read by one subscriber and loaded by `engine`; each beside a numpy copy of
  the published bytes, timed in between: `copy_s` into new memory (np.array, page faults
included, as the update's own writes have them), `copy_warm_s` into memory touched
before (bandwidth alone)."""
  dtype = sync.wire_dtype(model_cfg)
  pub = WeightPublisher(workdir, sync=sync, dtype=dtype, version=0)
  sub = WeightSubscriber(workdir, wire_template(params, dtype), verify=sync.verify)
  steps = {"publish_s": [], "subscribe_s": [], "load_s": [], "copy_s": [], "copy_warm_s": [],
           "engine_processing_s": []}
  nbytes, warm, via = 0, None, None
  try:
    for v in tqdm(range(1, updates + 1), desc=f"{sync.transport} updates", leave=False):
      t = time.perf_counter()
      pub.write_part(v, params)
      pub.commit(v)
      t1 = time.perf_counter()
      version, got = sub.poll()
      t2 = time.perf_counter()
      engine.update_weights(version, got)
      jax.block_until_ready(getattr(engine, "params", None))
      t3 = time.perf_counter()
      report = getattr(engine, "last_load", None)  # vLLM: its own reload, timed by its worker
      if report is not None:
        steps["engine_processing_s"].append(report["load_s"])
        via = report["via"]
      leaves = jax.tree.leaves(got)
      nbytes = sum(x.nbytes for x in leaves)
      t4 = time.perf_counter()
      copies = [np.array(x, copy=True) for x in leaves]
      steps["copy_s"].append(time.perf_counter() - t4)
      # The same copy into memory touched before: memory bandwidth alone, no page faults.
      warm = warm or [np.ones_like(x) for x in leaves]
      t5 = time.perf_counter()
      for dst, x in zip(warm, leaves):
        np.copyto(dst, x)
      steps["copy_warm_s"].append(time.perf_counter() - t5)
      del copies, got, leaves
      for key, dt in (("publish_s", t1 - t), ("subscribe_s", t2 - t1), ("load_s", t3 - t2)):
        steps[key].append(dt)
    reused = pub.pool.reused if pub.pool is not None else 0
  finally:
    pub.close()
  per = [a + b + c for a, b, c in zip(steps["publish_s"], steps["subscribe_s"], steps["load_s"])]
  if not steps["engine_processing_s"]:
    del steps["engine_processing_s"]
  out = {"transport": sync.transport, "weight_bytes": nbytes, "segments_reused": reused,
         "weight_dtype": str(dtype or "as trained"), "weight_update_s": _median(per),
         **{k: _median(x) for k, x in steps.items()}, "runs": {**steps, "weight_update_s": per}}
  copy = max(out["copy_s"], 1e-12)
  out.update(weight_update_vs_copy=out["weight_update_s"] / copy,
             engine_side_vs_copy=(out["subscribe_s"] + out["load_s"]) / copy,
             weight_update_vs_warm_copy=out["weight_update_s"] / max(out["copy_warm_s"], 1e-12))
  if "engine_processing_s" in steps:  # vLLM: what is not its own reload
    ours = [u - e for u, e in zip(per, steps["engine_processing_s"])]
    out.update(via=via, ours_s=_median(ours), ours_vs_copy=_median(ours) / copy,
               ours_vs_warm_copy=_median(ours) / max(out["copy_warm_s"], 1e-12))
  return out
