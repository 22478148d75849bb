"""Connecting the driver to Ray: an existing cluster by address, or a local one
started for the run; secure by default on more than one host.

Token authentication (Ray's RAY_AUTH_MODE=token): a local cluster started here gets
a fresh random token in an owner-only file (Ray's own `ray get-auth-token --generate`
writes a world-readable one); the driver refuses a cluster of more than one node that
runs without a token, unless RayConfig.allow_insecure says otherwise. A node or
client without the token cannot join, submit work or read objects.
"""
from __future__ import annotations

import dataclasses
import os
import secrets

import gin

# Liveness of a node (a cut link, a dead host): Ray's health check every 1 s, dead
# after 3 misses in a row, about 4-7 s in all (Ray's default is about a minute).
HEALTH_CHECK = dict(health_check_period_ms=1000, health_check_timeout_ms=1000,
                    health_check_failure_threshold=3)
# Ray's machinery the job does not use, off in a local cluster started here (measured:
# scripts/bench_cluster.py's ray.runtime_cpu_s, docs/distributed.md): no idle workers
# started ahead of need (each actor gets a process of its own as it is created), no
# metrics recorded for an exporter nobody reads (no dashboard), no task events sent to
# the GCS for the state API. The dashboard is off too (include_dashboard=False; Ray
# still runs its API server and agents, and the log monitor, which ray.init cannot
# turn off).
LEAN = dict(enable_worker_prestart=False, prestart_worker_first_driver=False,
            enable_metrics_collection=False, task_events_report_interval_ms=0)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RayConfig:
  """address: an existing cluster ('HOST:PORT' of its head, or 'auto' for the one this
    host's `ray start` joined); None starts a local one for the run (and stops it after).
  node_address: the local cluster's node address. Ray replaces 127.0.0.1 with the
    host's routable address; a loopback alias (127.0.0.2) keeps a local run on this
    machine only. None: Ray's choice.
  token_path: the cluster's auth token file; None: `WORKDIR/ray/auth_token` for a
    local cluster, $RAY_AUTH_TOKEN_PATH (or Ray's ~/.ray/auth_token) for an existing one.
  allow_insecure: run on a multi-node cluster without token authentication.
  trainers: trainer actors, one per host (jax.distributed across them when > 1);
    devices_per_trainer: CPU devices each (XLA_FLAGS; accelerators: what the host has).
  trainer_resources / rollout_resources: one placement-group bundle per actor (e.g.
    {'CPU': 1, 'trainer_host': 1} to pin trainers to nodes started with that resource).
  trainer_strategy / rollout_strategy: placement-group strategies; the trainers' are
    gang-scheduled (every bundle placed, or none), STRICT_SPREAD: one per node.
  coordinator: 'ray' (rank 0's node address and a free port) or 'auto'
    (jax.distributed's own detection: TPU pods, SLURM).
  worker_restarts: times Ray restarts each rollout actor; trainer_restarts: times a
    lost trainer group is rebuilt and the run resumed from its last checkpoint.
  startup_timeout_s: an actor's start, its first group included (compilation).
  call_deadline_s / call_deadline_factor: a rollout call is late after
    call_deadline_s + factor x (the dispatch's time estimate for its source) x (the
    groups queued ahead of it on its worker / groups_per_call + 1); a worker with a
    late call is killed (hung) and restarted, its groups re-dispatched.
  trainer_call_timeout_s: the longest a trainer call may take (a step, a checkpoint).
  env: environment for every actor (runtime_env env_vars), e.g. AWS_ENDPOINT_URL_S3;
    the driver's JAX_PLATFORMS and AWS_* variables are passed on too.
  """
  address: str | None = None
  node_address: str | None = None
  token_path: str | None = None
  allow_insecure: bool = False
  num_cpus: int | None = None
  trainers: int = 1
  devices_per_trainer: int = 1
  trainer_resources: dict = dataclasses.field(default_factory=lambda: {"CPU": 1})
  rollout_resources: dict = dataclasses.field(default_factory=lambda: {"CPU": 1})
  trainer_strategy: str = "STRICT_SPREAD"
  rollout_strategy: str = "SPREAD"
  coordinator: str = "ray"
  worker_restarts: int = 3
  trainer_restarts: int = 2
  startup_timeout_s: float = 300.0
  call_deadline_s: float = 60.0
  call_deadline_factor: float = 10.0
  trainer_call_timeout_s: float = 900.0
  env: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.trainers < 1:
      raise ValueError(f"RayConfig.trainers = {self.trainers} must be >= 1")
    if self.devices_per_trainer < 1:
      raise ValueError(f"RayConfig.devices_per_trainer = {self.devices_per_trainer} must be >= 1")
    if self.coordinator not in ("ray", "auto"):
      raise ValueError(f"RayConfig.coordinator = {self.coordinator!r}: use 'ray' or 'auto'")
    for name in ("trainer_strategy", "rollout_strategy"):
      if getattr(self, name) not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
        raise ValueError(f"RayConfig.{name} = {getattr(self, name)!r}: use PACK, SPREAD, "
                         "STRICT_PACK or STRICT_SPREAD")
    for name in ("worker_restarts", "trainer_restarts"):
      if getattr(self, name) < 0:
        raise ValueError(f"RayConfig.{name} = {getattr(self, name)} must be >= 0")
    for name in ("startup_timeout_s", "call_deadline_s", "trainer_call_timeout_s"):
      if getattr(self, name) <= 0:
        raise ValueError(f"RayConfig.{name} = {getattr(self, name)} must be > 0")


def write_token(path: str) -> str:
  """A fresh random token in `path`, readable by its owner only (mode 0600)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  if os.path.exists(path):
    os.remove(path)  # a file of another mode is not reused
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(secrets.token_hex(32))
  return path


def check_token_file(path: str) -> None:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"RayConfig.token_path = {path!r}: no such token file")
  mode = os.stat(path).st_mode & 0o777
  if mode & 0o077:
    raise PermissionError(f"RayConfig.token_path = {path!r} has mode {oct(mode)}: others can "
                          f"read the cluster's token; chmod 600 {path}")


def record_start(workdir: str, role: str) -> None:
  """`WORKDIR/logs/{role}.pid` (this process, the tests' handle for killing it) and a
  line in `logs/actors.log` (role, pid, node address): where each actor ran."""
  import ray
  logs = os.path.join(workdir, "logs")
  os.makedirs(logs, exist_ok=True)
  with open(os.path.join(logs, f"{role}.pid"), "w") as f:
    f.write(str(os.getpid()))
  with open(os.path.join(logs, "actors.log"), "a") as f:
    f.write(f"{role} {os.getpid()} {ray.util.get_node_ip_address()}\n")


def actor_env(cfg: RayConfig) -> dict:
  """Environment every actor gets: the driver's JAX platform, object-store settings and
  token, then RayConfig.env."""
  keep = ("JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
          "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
  env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("AWS_")}
  env.update(cfg.env)
  return env


def connect(cfg: RayConfig, workdir: str, log=print) -> bool:
  """ray.init for the run; True if this call started the cluster (the caller's to stop)."""
  try:
    import ray
  except ImportError as e:
    raise RuntimeError("JobConfig.cluster = 'ray' needs Ray: pip install 'ray==2.60.0' "
                       "(make install-ray)") from e
  if ray.is_initialized():  # a caller's session (the tests'): checked like any other
    _check_secure(cfg, ray)
    return False
  if cfg.address is None:
    token = cfg.token_path or os.path.join(workdir, "ray", "auth_token")
    if cfg.token_path is None:
      write_token(token)
    check_token_file(token)
    # Ray turns token mode on for a new local cluster when RAY_AUTH_MODE is unset
    # (setting it here, after Ray's import, would not reach Ray's cached config).
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token" and not cfg.allow_insecure:
      raise PermissionError(f"RAY_AUTH_MODE = {os.environ['RAY_AUTH_MODE']!r}: a local cluster "
                            "starts with token authentication; unset it, or set "
                            "RayConfig.allow_insecure = True")
    os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.abspath(token)
    ncpu = cfg.num_cpus or max(os.cpu_count() or 1, 16)  # logical CPUs: placement, not cores
    ray.init(num_cpus=ncpu, include_dashboard=False, _node_ip_address=cfg.node_address,
             _system_config={**HEALTH_CHECK, **LEAN}, log_to_driver=True,
             runtime_env={"env_vars": actor_env(cfg)})
    log(f"started a local Ray cluster at {ray.get_runtime_context().gcs_address} "
        f"(token in {token})")
    return True
  if cfg.token_path is not None:
    check_token_file(cfg.token_path)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.abspath(cfg.token_path)
  try:
    ray.init(address=cfg.address, log_to_driver=True, runtime_env={"env_vars": actor_env(cfg)})
  except ConnectionError as e:
    raise ConnectionError(f"RayConfig.address = {cfg.address!r}: no Ray cluster answered "
                          f"there ({e})") from e
  _check_secure(cfg, ray)
  return False


def token_auth_on() -> bool:
  return os.environ.get("RAY_AUTH_MODE", "").lower() == "token"


def _check_secure(cfg: RayConfig, ray) -> None:
  nodes = [n for n in ray.nodes() if n.get("Alive")]
  if len(nodes) > 1 and not token_auth_on() and not cfg.allow_insecure:
    ray.shutdown()
    raise PermissionError(
        f"a Ray cluster of {len(nodes)} nodes without token authentication: anyone who reaches "
        "it can run code on every node. Start it with RAY_AUTH_MODE=token and a token file "
        "(docs/distributed.md), or set RayConfig.allow_insecure = True")
