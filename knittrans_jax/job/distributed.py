"""jax.distributed set-up for trainer processes (Ray trainer actors,
cluster/trainer_actors.py): the project's one use of JAX internals.

With CPU devices the collectives are gloo's, and JAX's own CPU backend factory
gives gloo no listen address: it binds the address this machine's hostname resolves
to, which may be a loopback address another host cannot reach (as on this project's
test hosts, knittrans_jax/testing/netns.py). `_gloo_listens_on` re-registers the CPU
backend with gloo bound to this host's address; there is no public API for that.
Checked on jax 0.10.2 (`jax._src.xla_bridge.register_backend_factory`,
`jax._src.lib._jax.make_gloo_tcp_collectives`, `jax._src.distributed.global_state`).
GPUs and TPUs use their own collectives (NCCL, ICI) and need none of this.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

CHECKED_ON_JAX = "0.10.2"


@dataclasses.dataclass(frozen=True)
class ProcessSetup:
  """Where this trainer process sits; one process needs no coordinator.

  host_address: this host's address as the other trainer hosts reach it; gloo
  listens there. None: gloo's default (the hostname's address)."""
  coordinator_address: str | None = None
  num_processes: int = 1
  process_id: int = 0
  host_address: str | None = None

  def __post_init__(self):
    if self.num_processes < 1:
      raise ValueError(f"num_processes = {self.num_processes} must be >= 1")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id = {self.process_id} is outside [0, {self.num_processes})")


def initialize(setup: ProcessSetup, auto: bool = False) -> None:
  """jax.distributed with gloo for CPU devices; call before any other JAX work.
  auto: jax.distributed's own detection of the cluster (TPU pods, SLURM)."""
  if auto:
    jax.distributed.initialize()
    return
  if setup.num_processes == 1:
    return
  if not setup.coordinator_address:
    raise ValueError(f"num_processes = {setup.num_processes} needs a coordinator_address "
                     "(host:port of process 0)")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # The coordination service (process 0's; gRPC without credentials) listens on the
  # coordinator's own address, not JAX's default of every interface.
  jax.distributed.initialize(setup.coordinator_address, setup.num_processes, setup.process_id,
                             coordinator_bind_address=setup.coordinator_address)
  if setup.host_address:
    _gloo_listens_on(setup.host_address)


def _gloo_listens_on(address: str) -> None:
  """The CPU backend, when JAX creates it, with gloo bound to `address`."""
  from jax._src import distributed, xla_bridge
  from jax._src.lib import _jax
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized")
  if jax.__version__ != CHECKED_ON_JAX:
    print(f"note: gloo's listen address is set through JAX internals checked on jax "
          f"{CHECKED_ON_JAX}; this is {jax.__version__} (knittrans_jax/job/distributed.py)")
  collectives = _jax.make_gloo_tcp_collectives(distributed_client=client, hostname=address)
  xla_bridge.register_backend_factory(
      "cpu", functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
      priority=0, fail_quietly=False)
