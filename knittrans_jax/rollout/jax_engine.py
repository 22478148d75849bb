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

import time

import jax
import jax.numpy as jnp
import numpy as np

from knittrans_jax.rollout.engine import (EngineSpec, FinishedGroup, GroupRequest, PromptSpec,
                                          Response, RolloutEngine)
from knittrans_jax.rollout.sampler import SamplerConfig, generate

_keys = jax.jit(jax.vmap(jax.random.key))


def response_keys(seeds) -> jax.Array:
  """One sampling key per response, from its integer seed (GroupRequest.seeds): the
  key is a function of the seed alone, so a response draws the same in any call."""
  return _keys(np.asarray(seeds, np.uint32))


def generate_groups(graphdef, params, version: int, requests: list[GroupRequest],
                    sampler: SamplerConfig, prompts: PromptSpec = PromptSpec(),
                    seconds: float | None = None) -> list[FinishedGroup]:
  """Every response of `requests` in one sampler call; response i of a group samples
  with the key of its seed `seeds[i]` (`response_keys`)."""
  if not requests:
    return []
  rows = [r.prompt for r in requests for _ in range(r.n)]
  rng = response_keys([s for r in requests for s in r.seeds])
  index = np.repeat(np.arange(len(requests)), [r.n for r in requests])  # row -> its group
  extra = {}
  with_image = [r.image is not None for r in requests]
  if any(with_image):
    if not all(with_image):
      raise ValueError(f"groups {[r.group_id for r in requests if r.image is None]} have no "
                       "image where the others of the call have one")
    stored = [r.image for r in requests]
    qwen = prompts.image_inputs
    extra = dict(images=stored if qwen is not None else np.stack(stored), image_index=index,
                 qwen=qwen)
  tools = [r.tool for r in requests]
  if any(t is not None for t in tools):  # multi-turn tasks: rows without a tool get -1s
    calls = {t.call_token for t in tools if t is not None}
    if len(calls) > 1:
      raise ValueError(f"one sampler call takes one tool call token, got {sorted(calls)}")
    width = max(len(t.output) for t in tools if t is not None)
    outputs = [np.full(width, -1, np.int32) if t is None else np.asarray(t.output, np.int32)
               for t in tools]
    extra.update(tool_outputs=np.stack(outputs)[index], call_token=calls.pop())
  outs = generate(graphdef, params, rows, rng, sampler, prompt_len=prompts.length,
                  banned=prompts.banned, **extra)
  stops = set(sampler.stop_tokens)
  out, k = [], 0
  for r in requests:
    responses = tuple(
        Response(o.tokens, o.logprobs,
                 "stop" if o.tokens.size and int(o.tokens[-1]) in stops else "length",
                 (version, version), o.inserted if o.inserted is not None and o.inserted.any()
                 else None)
        for o in outs[k:k + r.n])
    k += r.n
    out.append(FinishedGroup(r, responses, seconds))
  return out


class JaxEngine(RolloutEngine):
  name = "jax"

  def __init__(self, spec: EngineSpec, graphdef, params, version: int):
    self.spec, self.graphdef = spec, graphdef
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
    done = generate_groups(self.graphdef, self.params, self.version, batch, self.spec.sampler,
                           self.spec.prompts)
    # A call of a new size compiled the sampler first: its time is not the groups'.
    seconds = time.perf_counter() - t0 if len(batch) in self._compiled else None
    self._compiled.add(len(batch))
    return [FinishedGroup(g.request, g.responses, seconds) for g in done]
