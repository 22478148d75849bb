"""A rollout worker process: prompts in, trajectories to its own storage unit,
metadata out. Picks up the newest published weights between engine steps.

The worker hands every queued group to its rollout engine (rollout/engine.py: 'jax',
a static batch per step; 'vllm', continuous batching) and reports each group the
step its last response finishes.

Messages: requests are (group_id, source); reports are ("done", worker, group_id,
[TrajMeta], seconds) or ("error", worker, message); seconds is the group's time in
the engine (its decode time, without the wait in this worker's queue; the dispatch
policies learn from it), None when it included compilation. A None request stops
the worker.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback

POLL_S = 0.02  # while busy: the queue and the weights are looked at after this much stepping


def one_device_xla_flags(flags: str) -> str:
  """The XLA flags less a forced host device count: one device per worker, the
  user's other flags (dumps, optimisation level) kept."""
  return " ".join(f for f in flags.split()
                  if not f.startswith("--xla_force_host_platform_device_count"))


def worker_main(worker_id: int, workdir: str, store_url: str, seed: int, n: int,
                model_config, sampler_config, requests, reports, stop,
                max_groups_per_call: int = 4, suite: str = "text", vision=None,
                math=None, host: str | None = None, engine: str = "jax",
                engine_options=None) -> None:
  if threading.current_thread() is threading.main_thread():  # a process of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when workers stop
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = one_device_xla_flags(os.environ.get("XLA_FLAGS", ""))
  from flax import nnx

  from knittrans_jax.models.vlm import make_model
  from knittrans_jax.rollout.engine import EngineSpec, make_engine
  from knittrans_jax.rollout.groups import Suite
  from knittrans_jax.rollout.weights import WeightSubscriber
  from knittrans_jax.storage import TrajectoryStore

  try:
    with nnx.use_eager_sharding(False):  # shapes only: the weights come from the trainer
      model = nnx.eval_shape(lambda: make_model(model_config, vision, nnx.Rngs(0)))
    graphdef, template = nnx.split(model, nnx.Param)
    weights = WeightSubscriber(workdir, template)
    writer = TrajectoryStore.open(store_url).writer(f"worker{worker_id}", host=host)
    tasks = Suite(suite, math, vision)
    spec = EngineSpec(engine, model_config, sampler_config, seed, max_groups_per_call,
                      engine_options, os.path.join(workdir, "engines", f"worker{worker_id}"))
    rollout = None  # built on the first published weights
    parent = multiprocessing.parent_process()
    while not stop.is_set():
      # Take what is queued; wait a little for it only while the engine is idle.
      batch, idle = [], rollout is None or not rollout.busy
      try:
        batch.append(requests.get(timeout=0.2) if idle else requests.get_nowait())
        while batch[-1] is not None:
          batch.append(requests.get_nowait())
      except queue.Empty:
        if idle and parent is not None and not parent.is_alive():
          break  # the trainer was killed (SIGKILL): do not linger as an orphan
      if None in batch:  # stop (the pool sets `stop` first): nothing more is reported
        break
      update = weights.poll()  # sync point: between engine steps
      if update is not None:
        if rollout is None:
          rollout = make_engine(spec, graphdef, update[1], update[0], suite=tasks)
        else:
          rollout.update_weights(*update)
      if rollout is None:
        if batch:
          raise RuntimeError("no published weights to generate with")
        continue
      rollout.add([tasks.request(seed, gid, source, n) for gid, source in batch])
      # Engine steps (a vLLM step takes milliseconds) until the next look at the queue,
      # the weights and `stop`.
      deadline = time.perf_counter() + POLL_S
      while rollout.busy:
        for group in rollout.step():
          rolled = tasks.rolled(seed, group)
          # The group's image is stored once, however many responses share it.
          metas = writer.append(rolled.trajectories, images=rolled.images)  # committed, then reported
          reports.put(("done", worker_id, group.request.group_id, metas, group.seconds))
        if time.perf_counter() > deadline:
          break
    if rollout is not None:
      rollout.close()
  except Exception:  # reported, then the process exits non-zero
    reports.put(("error", worker_id, traceback.format_exc()))
    raise
