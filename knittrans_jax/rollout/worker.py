"""A rollout worker process: prompts in, trajectories to its own storage unit,
metadata out. Picks up the newest published weights between engine steps.

Every group's n episodes run on an agent loop (rollout/agent_loop.py) over the
worker's rollout engine (rollout/engine.py: 'jax', a static batch of rows per step;
'vllm', continuous batching); a single-turn task is an episode of one step (its
suite's scorer, suites/base.py). A group is reported when its last episode ends, and
a group whose environment failed is reported as `GroupFailed` with the reason (the
controller replaces it).

Messages: requests are (group_id, source); reports are `GroupDone` (a committed
group's metadata; `seconds` is its time in the engine: its decode time, without the
wait in this worker's queue, which the dispatch policies learn from; None when it
included compilation; for episodes, from the group's start to its last episode's
end, environments included), `GroupFailed` (nothing of the group was committed) or
`WorkerError` (the worker's traceback; it then exits). A
None request stops the worker. Both pools read these (job/workers.py for local
processes, cluster/rollout_actors.py for Ray actors).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any

POLL_S = 0.02  # while busy: the queue and the weights are looked at after this much stepping


@dataclasses.dataclass(frozen=True)
class GroupDone:
  worker: int
  group_id: int
  metas: tuple  # TrajMeta, one per trajectory, committed before this report
  seconds: float | None


@dataclasses.dataclass(frozen=True)
class GroupFailed:
  worker: int
  group_id: int
  reason: str  # names the environment and the step


@dataclasses.dataclass(frozen=True)
class WorkerError:
  worker: int
  message: str  # the traceback


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
  """What every rollout worker of a run is built from (picklable: sent to worker
  processes and Ray actors). `n`: the group size; `model_config`: the decoder's
  DecoderConfig; `sampler_config`: rollout/sampler.SamplerConfig; `suite`: the run's
  task suite (suites/: its tasks, environments and model); `groups_per_call`: the
  'jax' engine's static batch, in groups of n rows (JobConfig.groups_per_call);
  `engine`: the backend (rollout/engine.ENGINES); `engine_options`: its options
  (VllmOptions for 'vllm', VllmServerOptions for 'vllm_server') or None; `weights`:
  the run's rollout/weights.WeightSyncConfig (its dtype and checks; None: leaves as
  the trainer holds them, crc32c checked)."""
  seed: int
  n: int
  model_config: Any
  sampler_config: Any
  suite: Any
  groups_per_call: int
  engine: str
  engine_options: Any
  weights: Any = None


def one_device_xla_flags(flags: str) -> str:
  """The XLA flags less a forced host device count: one device per worker, the
  user's other flags (dumps, optimisation level) kept."""
  return " ".join(f for f in flags.split()
                  if not f.startswith("--xla_force_host_platform_device_count"))


# JAX options read from the environment when JAX is imported: a worker forked from a
# fork server that imported JAX earlier (job/workers.py) sets them from its own (the
# compilation cache's through compile_cache.enable). Booleans as JAX reads them.
_JAX_ENV = {"JAX_PLATFORMS": ("jax_platforms", str), "JAX_ENABLE_X64": ("jax_enable_x64", bool)}
_TRUE = ("y", "yes", "t", "true", "on", "1")


def _take_environment(env: dict) -> None:
  """This process's environment becomes `env` (the parent's at the worker's start), and
  the JAX options read from it at import follow it. Before any JAX backend starts."""
  os.environ.clear()
  os.environ.update(env)
  import jax

  from knittrans_jax import compile_cache
  for name, (option, kind) in _JAX_ENV.items():
    if name in env:
      value = env[name]
      jax.config.update(option, value.lower() in _TRUE if kind is bool else value)
  compile_cache.enable(None)  # the parent's cache, if its environment names one


def worker_main(worker_id: int, workdir: str, store_url: str, args: WorkerArgs, requests,
                reports, stop, host: str | None = None, env: dict | None = None) -> None:
  """A worker's loop, until a None request or `stop`. `env`: the environment to take
  first (a process forked from job/workers.py's fork server)."""
  if threading.current_thread() is threading.main_thread():  # a process of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when workers stop
    env = dict(os.environ if env is None else env)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["XLA_FLAGS"] = one_device_xla_flags(env.get("XLA_FLAGS", ""))
    _take_environment(env)
  from flax import nnx

  from knittrans_jax import cpu_profile
  from knittrans_jax.cpu_profile import phase
  cpu_profile.start(f"worker{worker_id}", compute_phase="engine")
  from knittrans_jax.rollout.agent_loop import FailedGroup
  from knittrans_jax.rollout.engine import EngineSpec
  from knittrans_jax.rollout.engines import make_engine
  from knittrans_jax.rollout.weight_subscriber import WeightSubscriber
  from knittrans_jax.rollout.weights import wire_template
  from knittrans_jax.storage import TrajectoryStore

  try:
    a, seed, suite = args, args.seed, args.suite
    with nnx.use_eager_sharding(False):  # shapes only: the weights come from the trainer
      model = nnx.eval_shape(lambda: suite.make_model(a.model_config, nnx.Rngs(0)))
    graphdef, template = nnx.split(model, nnx.Param)
    sync = a.weights
    if sync is not None:  # the engine's dtype, as the trainer publishes it
      template = wire_template(template, sync.wire_dtype(a.model_config))
    weights = WeightSubscriber(workdir, template, verify=sync is None or sync.verify)
    writer = TrajectoryStore.open(store_url).writer(f"worker{worker_id}", host=host)
    # Each episode's turn is a request of n = 1: the JAX engine's static batch is
    # groups_per_call groups' rows.
    spec = EngineSpec(a.engine, a.model_config, a.sampler_config, seed, a.groups_per_call,
                      a.engine_options, os.path.join(workdir, "engines", f"worker{worker_id}"),
                      suite.prompt_spec, rows_per_call=a.groups_per_call * a.n, index=worker_id)
    engine = loop = None  # built on the first published weights
    held: dict[int, Any] = {}  # group id -> its task, which scores the finished group
    parent = multiprocessing.parent_process()
    while not stop.is_set():
      # Take what is queued; wait a little for it only while the engine is idle.
      batch, idle = [], loop is None or not loop.busy
      try:
        with phase("controller"):
          batch.append(requests.get(timeout=0.2) if idle else requests.get_nowait())
          while batch[-1] is not None:
            batch.append(requests.get_nowait())
      except queue.Empty:
        if idle and parent is not None and not parent.is_alive():
          break  # the trainer was killed (SIGKILL): do not linger as an orphan
      if None in batch:  # stop (the pool sets `stop` first): nothing more is reported
        break
      with phase("publish"):
        update = weights.poll()  # sync point: between engine steps
        if update is not None:
          if engine is None:
            engine = make_engine(spec, graphdef, update[1], update[0])
            loop = suite.agent_loop(engine, a.sampler_config)
          else:
            engine.update_weights(*update)
      if engine is None:
        if batch:
          raise RuntimeError("no published weights to generate with")
        continue
      with phase("engine"):
        for gid, source in batch:
          held[gid] = suite.task(seed, gid, source)
          suite.start(loop, held[gid], seed, gid, a.n)
      # Loop steps (a vLLM step takes milliseconds) until the next look at the queue,
      # the weights and `stop`.
      deadline = time.perf_counter() + POLL_S
      while loop.busy:
        with phase("engine"):
          finished = loop.step()
        for group in finished:
          task = held.pop(group.group_id)
          if isinstance(group, FailedGroup):
            reports.put(GroupFailed(worker_id, group.group_id, group.reason))
            continue
          with phase("engine"):  # scoring
            rolled = suite.rolled(task, group)
          # The group's image is stored once, however many responses share it.
          with phase("store_write"):
            metas = writer.append(rolled.trajectories, images=rolled.images)  # committed, then reported
          with phase("controller"):
            reports.put(GroupDone(worker_id, group.group_id, tuple(metas), suite.seconds(group)))
          cpu_profile.loop_started()  # (the first group's compilation is start-up)
        if time.perf_counter() > deadline:
          break
    if loop is not None:
      loop.close()
    if engine is not None:
      engine.close()
  except Exception:  # reported, then the process exits non-zero
    reports.put(WorkerError(worker_id, traceback.format_exc()))
    raise
  finally:
    cpu_profile.write()  # a forked process skips atexit
