"""The 'jax' rollout engine: the project's KV-cache sampler (rollout/sampler.py) behind
the engine interface (rollout/engine.py).

A static batch: each step takes up to `groups_per_call` queued groups and decodes them
in one sampler call, so every group of a step finishes with the step's longest
response (`groups_per_call = 1`: each group on its own longest response). The
reference backend (parity, the colocated and synchronous modes, held-out evaluation)
and the only one for images (a VLM's, prefilled with a processor's M-RoPE inputs).
Weights are swapped between calls: every response of a step has one version.

With `EngineSpec.rows_per_call` (agentic turns) a step takes queued requests up to
that many responses instead, and pads the call to a power-of-two row count and
prompt length (`bucket`): turns whose contexts grow with every observation then
compile a few shapes, not one per length (dummy rows repeat the first request and
are dropped; each row samples with its own key, so they change no real row).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import numpy as np

from knittrans_jax import compile_cache
from knittrans_jax.rollout.engine import (EngineSpec, FinishedGroup, GroupRequest, PromptSpec,
                                          Response, RolloutEngine)
from knittrans_jax.rollout.sampler import SamplerConfig, generate

_keys = jax.jit(jax.vmap(jax.random.key))
MIN_BUCKET = 16  # the shortest padded prompt length
MIN_ROWS = 4  # the fewest padded rows a call (fewer shapes; a dummy row costs little)


def bucket(n: int, least: int = MIN_BUCKET) -> int:
  """The power of two >= max(n, least): a padded shape."""
  return max(least, 1 << max(0, n - 1).bit_length())


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
    inputs = prompts.image_inputs  # a processor (Qwen-VL) takes the stored images as they are
    extra = dict(images=stored if inputs is not None else np.stack(stored), image_index=index,
                 image_inputs=inputs)
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
    # device_put, not jnp.asarray: on CPU it aliases aligned host arrays (a mapped
    # weight segment) instead of copying them.
    return jax.device_put(params)

  def add(self, requests: list[GroupRequest]) -> None:
    self.queue.extend(requests)

  @property
  def busy(self) -> bool:
    return bool(self.queue)

  def update_weights(self, version: int, params) -> None:
    self.params, self.version = self._device(params), version

  def step(self) -> list[FinishedGroup]:
    if self.spec.rows_per_call is not None:
      return self._step_rows()
    batch = self.queue[:self.spec.groups_per_call]
    self.queue = self.queue[len(batch):]
    return self._call(batch, self.spec.prompts, len(batch))

  def _call(self, batch: list[GroupRequest], prompts: PromptSpec, shape) -> list[FinishedGroup]:
    # A new shape is compiled by one process of the job; the others wait, then load it
    # from the persistent cache (compile_cache.py).
    lock = (contextlib.nullcontext() if shape in self._compiled else compile_cache.compiling(
        compile_cache.shape_key("jax_engine", self.spec.model_config, self.spec.sampler,
                                prompts.length, prompts.banned, shape)))
    with lock:
      t0 = time.perf_counter()
      done = generate_groups(self.graphdef, self.params, self.version, batch,
                             self.spec.sampler, prompts)
    # A call of a new shape compiled the sampler first: its time is not the groups'.
    seconds = time.perf_counter() - t0 if shape in self._compiled else None
    self._compiled.add(shape)
    return [FinishedGroup(g.request, g.responses, seconds) for g in done]

  def _step_rows(self) -> list[FinishedGroup]:
    batch, rows = [], 0
    while self.queue and (not batch or rows + self.queue[0].n <= self.spec.rows_per_call):
      batch.append(self.queue.pop(0))
      rows += batch[-1].n
    length = self.spec.prompts.length or bucket(max(r.prompt.size for r in batch))
    width = bucket(rows, least=self._min_rows)
    first = batch[0]
    pad = [dataclasses.replace(first, group_id=-1 - k, n=1, seeds=(k,))
           for k in range(width - rows)]
    done = self._call(batch + pad, dataclasses.replace(self.spec.prompts, length=length),
                      (width, length))
    return done[:len(batch)]

  def compile_shapes(self, max_prompt_len: int) -> int:
    """Runs (so compiles) every shape a `rows_per_call` engine can meet with prompts of
    up to `max_prompt_len` tokens, on throwaway rows; returns how many shapes that is.
    A benchmark calls it first, so that no timed step compiles."""
    if self.spec.rows_per_call is None:
      raise ValueError("compile_shapes: an engine with EngineSpec.rows_per_call (agentic turns)")
    top = bucket(self.spec.rows_per_call, least=self._min_rows)
    widths = [1 << k for k in range(self._min_rows.bit_length() - 1, top.bit_length())]
    lengths = ([self.spec.prompts.length] if self.spec.prompts.length else
               [1 << k for k in range(MIN_BUCKET.bit_length() - 1,
                                      bucket(max_prompt_len).bit_length())])
    for w in widths:
      for length in lengths:
        if (w, length) not in self._compiled:
          rows = [GroupRequest(-1 - k, "", np.full(length, 2, np.int32), 1, (k,))
                  for k in range(w)]
          self._call(rows, dataclasses.replace(self.spec.prompts, length=length), (w, length))
    return len(widths) * len(lengths)

  @property
  def _min_rows(self) -> int:
    return min(MIN_ROWS, bucket(self.spec.rows_per_call, least=1))

  @property
  def compiled_shapes(self) -> int:
    """Distinct sampler call shapes this engine ran (each compiled once)."""
    return len(self._compiled)
