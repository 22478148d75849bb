"""The rollout engine interface: what a rollout worker asks of an inference engine.

    engine = make_engine(EngineSpec('vllm', ...), graphdef, first_weights, version, suite)
    engine.add(requests)                 # GroupRequests: token-id prompts, n, one seed each
    while engine.busy:
      engine.update_weights(v, params)   # between engine steps, whenever v is published
      for group in engine.step():        # the groups whose last response just finished
        ...                              # score, commit to the store, report

Backends (`ENGINES`): 'jax' (rollout/jax_engine.py: the project's KV-cache sampler, a
static batch of up to `groups_per_call` groups per step; the reference, and the only
one for the vision suites) and 'vllm' (rollout/vllm_engine.py: an in-process vLLM
engine, continuous batching, each group returned the step its last response ends).

Every engine returns, per response, the sampled tokens (up to and including the stop
token), the log-probs of the distribution actually sampled (logits / temperature,
restricted to the top-p nucleus and renormalised), the finish reason and the first and
last weight version that produced its tokens.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any

import numpy as np

ENGINES = ("jax", "vllm")


@dataclasses.dataclass(frozen=True)
class GroupRequest:
  """One GRPO group: n responses to one prompt. `seeds[i]` seeds response i (engines
  that take integer seeds; the JAX engine keys response i by (job seed, group id, i),
  which is the same function of the request). `extra`: what only the JAX engine takes
  (a VLM's image, a Qwen-VL prompt's image inputs)."""
  group_id: int
  source: str
  prompt: np.ndarray  # int32 [P]
  n: int
  seeds: tuple[int, ...]
  extra: Any = None
  task: Any = None  # the caller's (the worker scores with it); engines ignore it

  def __post_init__(self):
    if len(self.seeds) != self.n:
      raise ValueError(f"GroupRequest {self.group_id}: {len(self.seeds)} seeds for n = {self.n}")


@dataclasses.dataclass(frozen=True)
class Response:
  tokens: np.ndarray  # int32 [R]
  logprobs: np.ndarray  # float32 [R], of the distribution sampled
  finish_reason: str  # 'stop' (a stop token, included in tokens) or 'length'
  versions: tuple[int, int]  # (first, last) weight version that generated its tokens
  # bool [R]: the tokens a tool inserted (not sampled; no loss on them). None: none.
  inserted: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class FinishedGroup:
  """`seconds`: from the start of the engine step that gave the group its first token
  to the end of the one that finished it (its decode time, which dispatch learns from;
  not its wait in a queue); None when that span included compilation."""
  request: GroupRequest
  responses: tuple[Response, ...]
  seconds: float | None


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """What a worker needs to build its engine (picklable, sent to worker processes).
  `model_config`: the decoder's DecoderConfig; `options`: backend options
  (VllmOptions for 'vllm')."""
  name: str
  model_config: Any
  sampler: Any  # rollout.sampler.SamplerConfig
  seed: int
  groups_per_call: int = 4
  options: Any = None
  workdir: str | None = None  # where an engine that loads from disk writes its weights

  def __post_init__(self):
    if self.name not in ENGINES:
      raise ValueError(f"rollout engine {self.name!r} is unknown; use one of {ENGINES}")


class RolloutEngine(abc.ABC):
  """Groups in, finished groups out, weights swapped between steps."""

  name: str

  @abc.abstractmethod
  def add(self, requests: list[GroupRequest]) -> None:
    """Queues groups; they start at the engine's next step."""

  @abc.abstractmethod
  def step(self) -> list[FinishedGroup]:
    """One engine step; returns the groups whose last response finished in it."""

  @abc.abstractmethod
  def update_weights(self, version: int, params) -> None:
    """The decoder's parameters (an nnx.State of host arrays) at `version`, for every
    token generated from the next step on."""

  @property
  @abc.abstractmethod
  def busy(self) -> bool:
    """Groups queued or in flight."""

  def close(self) -> None:
    pass

  def generate(self, requests: list[GroupRequest]) -> list[FinishedGroup]:
    """Runs `requests` to completion; the groups in request order."""
    self.add(requests)
    done = {}
    while self.busy:
      for g in self.step():
        done[g.request.group_id] = g
    return [done[r.group_id] for r in requests]


def response_seeds(seed: int, group_id: int, n: int) -> tuple[int, ...]:
  """Integer seeds of a group's n responses: a pure function of (seed, group id, i)."""
  state = np.random.SeedSequence([seed, group_id]).generate_state(n, np.uint32)
  return tuple(int(s) >> 1 for s in state)  # 31 bits: any engine's int seed takes them


def make_engine(spec: EngineSpec, graphdef, params, version: int, suite=None) -> RolloutEngine:
  """The engine `spec` names, holding `params` (an nnx.State of host arrays) at `version`.
  `suite`: the task suite (rollout/groups.Suite) the JAX engine needs for prompt lengths
  and a vision suite's images. Imported here, not above: vLLM loads only when used."""
  if spec.name == "vllm":
    from knittrans_jax.rollout.vllm_engine import VllmEngine
    return VllmEngine(spec, params, version)
  from knittrans_jax.rollout.jax_engine import JaxEngine
  if suite is None:
    raise ValueError("the 'jax' rollout engine needs the task suite (rollout/groups.Suite)")
  return JaxEngine(spec, graphdef, params, version, suite)
