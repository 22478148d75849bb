"""The 'jax' rollout engine: the project's KV-cache sampler (rollout/sampler.py) behind
the engine interface (rollout/engine.py).

A static batch: each step takes up to `groups_per_call` queued groups and decodes them
in one sampler call, so every group of a step finishes with the step's longest
response (`groups_per_call = 1`: each group on its own longest response). The
reference backend (parity, the colocated and synchronous modes, held-out evaluation)
and the only one for the vision suites (a VLM's image, Qwen-VL's M-RoPE prefill).
Weights are swapped between calls: every response of a step has one version.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from knittrans_jax.rollout.engine import (EngineSpec, FinishedGroup, GroupRequest, Response,
                                          RolloutEngine)
from knittrans_jax.rollout.sampler import SamplerConfig, generate


@functools.partial(jax.jit, static_argnums=2)
def _group_keys(seed, group_ids, n):
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), group_ids)
  return jax.vmap(lambda k: jax.random.split(k, n))(keys).reshape(-1)


def group_keys(seed: int, group_ids: list[int], n: int) -> jax.Array:
  """One sampling key per response: [len(group_ids) * n], group-major."""
  return _group_keys(np.uint32(seed), np.asarray(group_ids, np.uint32), n)


def generate_groups(graphdef, params, version: int, seed: int, requests: list[GroupRequest],
                    sampler: SamplerConfig, suite, seconds: float | None = None
                    ) -> list[FinishedGroup]:
  """Every response of `requests` in one sampler call. Response i of group g samples
  with key (seed, g, i) (`group_keys`). `suite`: rollout/groups.Suite (a vision group's
  `extra` is its image)."""
  if not requests:
    return []
  n = requests[0].n
  prompts = [r.prompt for r in requests for _ in range(r.n)]
  rng = group_keys(seed, [r.group_id for r in requests], n)
  extra = {}
  if suite.name == "vision":
    stored = [r.extra for r in requests]
    qwen = suite.qwen
    extra = dict(images=stored if qwen is not None else np.stack(stored),
                 image_index=np.repeat(np.arange(len(requests)), n),
                 qwen=qwen.inputs if qwen is not None else None,
                 banned=qwen.special_ids if qwen is not None else ())
  tools = [getattr(r.task, "tool_output", None) for r in requests]
  if any(t is not None for t in tools):  # multi-turn tasks: rows without a tool get -1s
    width = max(len(t) for t in tools if t is not None)
    rows = [np.full(width, -1, np.int32) if t is None else np.asarray(t, np.int32)
            for t in tools]
    extra.update(tool_outputs=np.repeat(np.stack(rows), n, axis=0),
                 call_token=suite.call_token)
  outs = generate(graphdef, params, prompts, rng, sampler, prompt_len=suite.prompt_len, **extra)
  stops = set(sampler.stop_tokens)
  out = []
  for k, r in enumerate(requests):
    responses = tuple(
        Response(o[0], o[1], "stop" if o[0].size and int(o[0][-1]) in stops else "length",
                 (version, version), o[2] if len(o) > 2 and o[2].any() else None)
        for o in outs[k * n:(k + 1) * n])
    out.append(FinishedGroup(r, responses, seconds))
  return out


class JaxEngine(RolloutEngine):
  name = "jax"

  def __init__(self, spec: EngineSpec, graphdef, params, version: int, suite):
    """`suite`: rollout/groups.Suite (prompt length, a vision suite's image inputs)."""
    self.spec, self.graphdef, self.suite = spec, graphdef, suite
    self.params, self.version = self._device(params), version
    self.queue: list[GroupRequest] = []
    self._compiled: set[int] = set()  # groups-per-call sizes the sampler compiled for

  @staticmethod
  def _device(params):
    return jax.tree.map(jnp.asarray, params)

  def add(self, requests: list[GroupRequest]) -> None:
    self.queue.extend(requests)

  @property
  def busy(self) -> bool:
    return bool(self.queue)

  def update_weights(self, version: int, params) -> None:
    self.params, self.version = self._device(params), version

  def step(self) -> list[FinishedGroup]:
    batch = self.queue[:self.spec.groups_per_call]
    self.queue = self.queue[len(batch):]
    t0 = time.perf_counter()
    done = generate_groups(self.graphdef, self.params, self.version, self.spec.seed, batch,
                           self.spec.sampler, self.suite)
    # A call of a new size compiled the sampler first: its time is not the groups'.
    seconds = time.perf_counter() - t0 if len(batch) in self._compiled else None
    self._compiled.add(len(batch))
    return [FinishedGroup(g.request, g.responses, seconds) for g in done]
