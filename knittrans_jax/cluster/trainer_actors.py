"""Trainers as Ray actors: one per host in a gang-scheduled placement group, under
jax.distributed when there are several, driven by the controller with direct actor
calls (metadata only: a mini-batch's plan, when to publish and checkpoint).

Each actor builds the same `Trainer` a local run builds (job/build_trainer.make_trainer),
from the driver's gin config. Calls to one actor run in the order they
were made, so `step` can return at once (the devices compute on) and a later
`fetch` brings the step's metrics back: the driver admits and reads the next
mini-batch meanwhile, as in one process.

A trainer that dies (its process, its host) fails every call on the group; a
survivor inside a collective fails too (gloo sees its peer gone) rather than hang,
and a call past RayConfig.trainer_call_timeout_s is taken as a hang. A restarted
process cannot rejoin jax.distributed, so the whole group is torn down
(`TrainerLost`); cluster/ray_job.py rebuilds it on a new port and resumes the run
from its last checkpoint.
"""
from __future__ import annotations

import os
import socket
from typing import Callable

from knittrans_jax.cluster.ray_setup import RayConfig, actor_env, record_start
from knittrans_jax.job.roles import TrainerLost
from knittrans_jax.rollout.weight_subscriber import WeightSubscriber
from knittrans_jax.rollout.weights import WeightPublisher, WeightSyncConfig
from knittrans_jax.rollout.worker import one_device_xla_flags


def _free_port(host: str) -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class TrainerActor:
  """Trainer `rank` of `world` (see module doc)."""

  def __init__(self, rank: int, world: int, workdir: str):
    self.rank, self.world, self.workdir = rank, world, workdir
    self.trainer, self.results = None, []
    record_start(workdir, f"trainer{rank}")

  def address(self) -> tuple[str, int]:
    """This node's address and a free port on it: the coordinator's, for rank 0."""
    import ray
    host = ray.util.get_node_ip_address()
    return host, _free_port(host)

  def setup(self, gin_config: str, coordinator: str | None, auto: bool, resume: bool,
            store_url: str, consumers: int) -> dict:
    import gin
    import ray
    from knittrans_jax.job import distributed
    if self.world > 1 or auto:
      distributed.initialize(distributed.ProcessSetup(
          coordinator, self.world, self.rank,
          host_address=None if auto else ray.util.get_node_ip_address()), auto=auto)
    from knittrans_jax import gin_cli
    from knittrans_jax.job import local  # noqa: F401  (registers what a job's config names)
    from knittrans_jax.job.build_trainer import Placement, make_trainer
    from knittrans_jax.job.config import JobConfig
    from knittrans_jax.job.setup import job_setup
    from knittrans_jax.storage import TrajectoryStore
    gin.clear_config()
    gin.parse_config(gin_config)
    # The node's address: what the rollout actors register their units under.
    host = ray.util.get_node_ip_address()
    built = make_trainer(job_setup(JobConfig()), self.workdir, TrajectoryStore.open(store_url),
                         Placement(self.rank, self.world, consumers, host), resume)
    self.trainer = t = built.trainer
    if self.rank == 0:  # what the trainers used (the driver's operative config lacks it)
      gin_cli.save_operative_config(self.workdir, "operative_config_trainer.gin")
    return dict(version=t.version, progress=built.progress, rows_multiple=built.rows_multiple,
                shared_images=t.shared_step is not None,
                devices=[str(d) for d in built.mesh.devices.flat], host=host,
                consumers=list(t.mine))

  def prefetch(self, work) -> None:
    self.trainer.prefetch(work)

  def step(self, key) -> None:
    self.results.append(self.trainer.step(self.trainer.pending(key)))

  def fetch(self, write_weights: bool):
    """The step's metrics, whether a checkpoint is due at its version and the latest
    checkpoint wholly written; with `write_weights`, this trainer's shards of that
    version are written first (the driver publishes every step: one round trip)."""
    sums, grad_norm = self.results.pop(0).fetch()
    if write_weights:
      self.trainer.write_weights()
    return sums, grad_norm, self.trainer.save_due(), self.trainer.durable_step()

  def write_weights(self) -> None:
    self.trainer.write_weights()

  def save(self, progress: dict, force: bool) -> bool:
    return self.trainer.save(progress, force)

  def finish(self) -> dict:
    t = self.trainer
    t.finish(self.workdir)
    return dict(exposed_wait_s=t.exposed_wait_s, raw_transfer_s=t.raw_transfer_s)

  def ping(self) -> int:
    return os.getpid()


class _StepResult:
  def __init__(self, group: "RayTrainerGroup"):
    self.group = group

  def fetch(self):
    g = self.group
    sums, grad_norm, g.due, g.durable = g._get([a.fetch.remote(True) for a in g.actors],
                                               "a step")[0]
    g.written = g.version  # every actor wrote its shards of this version
    return sums, grad_norm


class RayTrainerGroup:
  """The driver's handle on the trainer actors (job/roles.TrainerHandle).

  `eval_template`: the policy's parameter shapes (an nnx.State of ShapeDtypeStructs);
  held-out evaluation in the driver reads the published version into it. `weights`:
  the run's resolved WeightSyncConfig (the actors resolve the same one)."""

  def __init__(self, cfg: RayConfig, workdir: str, resume: bool, store_url: str,
               consumers: int, gin_config: str, eval_template=None,
               log: Callable[[str], None] = print, weights: WeightSyncConfig | None = None):
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    self.ray, self.cfg, self.log = ray, cfg, log
    self.stats = dict(exposed_wait_s=0.0, raw_transfer_s=0.0)
    self.due = False  # a checkpoint is due at the last fetched step's version
    self.durable = None  # the latest checkpoint wholly written, as of the last fetch
    self.written = None  # the version whose shards every actor has written
    self.committed = None  # the version last made the latest
    # The driver commits what the actors wrote ('ray': it creates the registry first).
    self.publisher = WeightPublisher(workdir, sync=weights)
    self.weights = WeightSubscriber(workdir, eval_template) if eval_template is not None else None
    self.eval_cache = None  # (version, params) last read for evaluation
    self.pending = []  # refs not yet checked (prefetch, step): their errors surface later
    T = cfg.trainers
    bundle = dict(cfg.trainer_resources)
    self.pg = placement_group([bundle] * T, strategy=cfg.trainer_strategy)
    self.actors = []
    try:
      ray.get(self.pg.ready(), timeout=cfg.startup_timeout_s)
    except ray.exceptions.GetTimeoutError:
      self.close()
      raise RuntimeError(f"RayConfig.trainers = {T} actors of {bundle} ({cfg.trainer_strategy}) "
                         f"could not be placed in {cfg.startup_timeout_s:g} s; the cluster has "
                         f"{ray.available_resources()}") from None
    # The driver's other XLA flags (dumps, optimisation level) kept; its device count not.
    flags = one_device_xla_flags(os.environ.get("XLA_FLAGS", ""))
    env = {**actor_env(cfg), "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count="
                                          f"{cfg.devices_per_trainer}".strip()}
    cls = ray.remote(TrainerActor)
    self.actors = [cls.options(
        max_restarts=0, max_task_retries=0, num_cpus=bundle.get("CPU", 0),
        num_gpus=bundle.get("GPU", 0),
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, r),
        runtime_env={"env_vars": env}).remote(r, T, workdir) for r in range(T)]
    host, port = self._get([self.actors[0].address.remote()], "start-up",
                           cfg.startup_timeout_s)[0]
    auto = cfg.coordinator == "auto"
    coordinator = None if auto else f"{host}:{port}"
    infos = self._get([a.setup.remote(gin_config, coordinator, auto, resume, store_url, consumers)
                       for a in self.actors], "set-up", cfg.startup_timeout_s)
    info = infos[0]
    self.version, self.progress = info["version"], info["progress"]
    self.rows_multiple, self.shared_images = info["rows_multiple"], info["shared_images"]
    host_of = {c: i["host"] for i in infos for c in i["consumers"]}
    self.consumer_host = tuple(host_of[c] for c in range(consumers))  # the planner's locality
    self.devices = tuple(info["devices"])  # the trainers' mesh, every process's devices
    log(f"{T} trainer actor(s), coordinator {coordinator or 'auto-detected'}, "
        f"{len(info['devices'])} devices")

  def _get(self, refs, what: str, timeout: float | None = None):
    ray, n = self.ray, len(refs)
    refs, self.pending = self.pending + refs, []
    try:
      return ray.get(refs, timeout=timeout or self.cfg.trainer_call_timeout_s)[-n:]
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
      raise TrainerLost(f"a trainer actor died during {what}: {e}") from e
    except ray.exceptions.GetTimeoutError as e:
      raise TrainerLost(f"the trainers' {what} took longer than "
                        f"RayConfig.trainer_call_timeout_s = {self.cfg.trainer_call_timeout_s:g} s"
                        ) from e
    except ray.exceptions.RayTaskError as e:
      dead = self._dead()
      if dead:  # a survivor's collective failed because a peer died
        raise TrainerLost(f"trainer actor(s) {dead} died during {what}") from e
      raise e.as_instanceof_cause() from None  # the trainer's own error (a bad config, ...)

  def _dead(self) -> list[int]:
    dead = []
    for r, a in enumerate(self.actors):
      try:
        self.ray.get(a.ping.remote(), timeout=10)
      except Exception:  # noqa: BLE001  (dead, restarting or unreachable: lost either way)
        dead.append(r)
    return dead

  def prefetch(self, work) -> None:
    self.pending += [a.prefetch.remote(work) for a in self.actors]

  def step(self, work):
    self.pending += [a.step.remote(work.key) for a in self.actors]
    self.version += 1
    return _StepResult(self)

  def publish(self) -> None:
    """Every actor writes its shards (with the step's fetch, or now); then this
    process (the work dir is shared) makes the version the latest."""
    if self.written != self.version:
      self._get([a.write_weights.remote() for a in self.actors], "publishing weights")
      self.written = self.version
    if self.committed != self.version:
      self.publisher.commit(self.version, parts=len(self.actors))
      self.committed = self.version

  def eval_params(self):
    """The current version's parameters on this host, read from what the actors
    publish (the driver holds no model state): published first if it is not yet."""
    if self.weights is None:
      raise ValueError("RayTrainerGroup: no eval_template given, so no parameters to evaluate")
    self.publish()
    if self.eval_cache is None or self.eval_cache[0] != self.version:
      update = self.weights.poll()
      if update is None or update[0] != self.version:
        raise RuntimeError(f"weights v{self.version} were published but the driver read "
                           f"{None if update is None else update[0]}")
      self.eval_cache = update
    return self.eval_cache[1]

  def save_due(self) -> bool:
    return self.due

  def save(self, progress: dict, force: bool = False) -> bool:
    return self._get([a.save.remote(progress if r == 0 else {}, force)
                      for r, a in enumerate(self.actors)], "a checkpoint")[0]

  def durable_step(self) -> int | None:
    return self.durable

  @property
  def exposed_wait_s(self) -> float:
    return self.stats["exposed_wait_s"]

  @property
  def raw_transfer_s(self) -> float:
    return self.stats["raw_transfer_s"]

  def finish(self) -> None:
    try:
      self.stats = self._get([a.finish.remote() for a in self.actors], "finishing")[0]
    finally:
      self.close()

  def abort(self, reason: str) -> None:
    self.log(f"\nstopping the trainer actors: {reason}")
    self.close()

  def close(self) -> None:
    for a in self.actors:
      self.ray.kill(a, no_restart=True)
    self.actors = []
    self.publisher.close()  # 'ray': the registry actor goes with the group that made it
    if self.pg is not None:
      self.ray.util.remove_placement_group(self.pg)
      self.pg = None
