"""The trainer as several processes under jax.distributed: set-up and the plan channel.

Process 0 runs the controller (admission, dispatch, rollout workers, metrics) and
every process is a trainer: one jitted step over a mesh spanning all processes'
devices. The controller shares its decisions (a mini-batch's micro-batch plan,
advantages, token count; when to publish weights and checkpoint) as pickled
metadata through the coordination service's key-value store; no payload goes
through it. Each process then reads only its own consumers' micro-batches from the
store and builds the global arrays with `jax.make_array_from_process_local_data`.

The key-value store rather than a collective broadcast: a follower may wait minutes
for the next plan (the controller is waiting for rollouts), and a blocking KV get
has no collective timeout to hit.
"""
from __future__ import annotations

import dataclasses
import functools
import pickle

import jax

_PREFIX = "knittrans/cmd/"
_WAIT_MS = 24 * 3600 * 1000  # a follower waits as long as the controller needs


@dataclasses.dataclass(frozen=True)
class ProcessSetup:
  """Where this trainer process sits; one process needs no coordinator.

  host_address: this host's address as the other trainer hosts reach it; the CPU
  collectives (gloo) listen there. None: the address this machine's hostname
  resolves to, gloo's default (which may be a loopback address another host cannot
  reach, as on this project's test hosts, knittrans_jax/testing/netns.py)."""
  coordinator_address: str | None = None
  num_processes: int = 1
  process_id: int = 0
  host_address: str | None = None

  def __post_init__(self):
    if self.num_processes < 1:
      raise ValueError(f"num_processes = {self.num_processes} must be >= 1")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id = {self.process_id} is outside [0, {self.num_processes})")
    if self.num_processes > 1 and not self.coordinator_address:
      raise ValueError(f"num_processes = {self.num_processes} needs a coordinator_address "
                       "(host:port of process 0)")


def initialize(setup: ProcessSetup) -> None:
  """jax.distributed with the gloo CPU collectives (used only when the devices are
  CPUs; GPUs and TPUs use their own). Call before any other JAX work."""
  if setup.num_processes == 1:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(setup.coordinator_address, setup.num_processes, setup.process_id)
  if setup.host_address:
    _gloo_listens_on(setup.host_address)


def _gloo_listens_on(address: str) -> None:
  """The CPU backend, when JAX creates it, with gloo bound to `address`: JAX's own
  factory passes no address, and gloo's default is this hostname's address."""
  from jax._src import xla_bridge
  from jax._src.lib import _jax
  collectives = _jax.make_gloo_tcp_collectives(distributed_client=_client(), hostname=address)
  xla_bridge.register_backend_factory(
      "cpu", functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
      priority=0, fail_quietly=False)


def _client():
  from jax._src import distributed  # the coordination service's client (orbax uses it too)
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized")
  return client


class PlanChannel:
  """Ordered messages from process 0 to every other process (metadata only).

  Message k for follower p is written under its own key; the follower deletes it
  once read, so the coordination service holds only messages not yet consumed.
  """

  def __init__(self):
    self.process = jax.process_index()
    self.count = jax.process_count()
    self.seq = 0

  def send(self, message) -> None:
    if self.process != 0:
      raise RuntimeError("only process 0 sends plans")
    if self.count > 1:
      data = pickle.dumps(message)
      client = _client()
      for p in range(1, self.count):
        client.key_value_set_bytes(f"{_PREFIX}{p}/{self.seq}", data)
    self.seq += 1

  def receive(self):
    client = _client()
    key = f"{_PREFIX}{self.process}/{self.seq}"
    data = client.blocking_key_value_get_bytes(key, _WAIT_MS)
    client.key_value_delete(key)
    self.seq += 1
    return pickle.loads(data)


def barrier(name: str, timeout_s: int = 600) -> None:
  if jax.process_count() > 1:
    _client().wait_at_barrier(name, timeout_s * 1000)


def all_done(name: str) -> None:
  """Processes > 0 announce that they finished `name`; process 0 returns once every
  one has (e.g. each wrote its part of a weights version)."""
  count = jax.process_count()
  if count == 1:
    return
  client, p = _client(), jax.process_index()
  if p:
    client.key_value_set(f"knittrans/done/{name}/{p}", "1")
    return
  for q in range(1, count):
    key = f"knittrans/done/{name}/{q}"
    client.blocking_key_value_get(key, _WAIT_MS)
    client.key_value_delete(key)
