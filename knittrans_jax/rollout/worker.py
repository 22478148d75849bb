"""A rollout worker process: prompts in, trajectories to its own storage unit,
metadata out. Picks up the newest published weights before each group.

Messages: requests are (group_id, source); reports are ("done", worker, group_id,
[TrajMeta], seconds) or ("error", worker, message); seconds is the sampler call that
generated the group (its decode time, without the wait in this worker's queue; the
dispatch policies learn from it), None when that call also compiled the sampler. A
None request stops the worker.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time
import traceback


def worker_main(worker_id: int, workdir: str, store_url: str, seed: int, n: int,
                model_config, sampler_config, requests, reports, stop,
                max_groups_per_call: int = 4, suite: str = "text", vit_config=None,
                math=None, host: str | None = None) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when workers stop
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = ""  # one device per worker
  from flax import nnx

  from knittrans_jax.models.vlm import make_model
  from knittrans_jax.rollout.groups import rollout_groups
  from knittrans_jax.rollout.qwen_vision_tasks import QwenVisionTasks
  from knittrans_jax.rollout.weights import WeightSubscriber
  from knittrans_jax.storage import TrajectoryStore

  try:
    with nnx.use_eager_sharding(False):  # shapes only: the weights come from the trainer
      model = nnx.eval_shape(lambda: make_model(model_config, vit_config, nnx.Rngs(0)))
    graphdef, template = nnx.split(model, nnx.Param)
    weights = WeightSubscriber(workdir, template)
    writer = TrajectoryStore.open(store_url).writer(f"worker{worker_id}", host=host)
    params, version = None, -1
    compiled: set[int] = set()  # groups-per-call sizes the sampler has compiled for
    parent = multiprocessing.parent_process()
    while not stop.is_set():
      try:
        req = requests.get(timeout=0.2)
      except queue.Empty:
        if parent is not None and not parent.is_alive():
          break  # the trainer was killed (SIGKILL): do not linger as an orphan
        continue
      if req is None:
        break
      batch = [req]
      while len(batch) < max_groups_per_call:  # take what is queued, without waiting
        try:
          more = requests.get_nowait()
        except queue.Empty:
          break
        if more is None:
          stop.set()
          break
        batch.append(more)
      update = weights.poll()  # sync point: between sampler calls
      if update is not None:
        version, params = update
      if params is None:
        raise RuntimeError("no published weights to generate with")
      image_size = vit_config.image_size if vit_config is not None else 0
      t0 = time.perf_counter()
      groups = rollout_groups(graphdef, params, version, seed, batch, n, sampler_config,
                              suite, image_size, math,
                              qwen=vit_config if isinstance(vit_config, QwenVisionTasks) else None)
      # A call of a new size compiled the sampler first: its time is not the group's.
      seconds = time.perf_counter() - t0 if len(batch) in compiled else None
      compiled.add(len(batch))
      for group in groups:
        # The group's image is stored once, however many responses share it.
        metas = writer.append(group.trajectories, images=group.images)  # committed, then reported
        reports.put(("done", worker_id, group.trajectories[0].group_id, metas, seconds))
  except Exception:  # reported, then the process exits non-zero
    reports.put(("error", worker_id, traceback.format_exc()))
    raise
