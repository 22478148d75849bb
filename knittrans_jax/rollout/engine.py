"""The rollout engine interface: what a rollout worker asks of an inference engine.

    engine = make_engine(EngineSpec('vllm', ...), graphdef, first_weights, version)
    engine.add(requests)                 # GroupRequests: token-id prompts, n, one seed each
    while engine.busy:
      engine.update_weights(v, params)   # between engine steps, whenever v is published
      for group in engine.step():        # the groups whose last response just finished
        ...                              # score, commit to the store, report

This module is the interface only (data and an ABC); the factory `make_engine` is in
rollout/engines.py, which imports the backends. Engines see requests, never tasks:
the caller keeps each group's task beside its request and scores with it.

Backends (`ENGINES`): 'jax' (rollout/jax_engine.py: the project's KV-cache sampler, a
static batch of up to `groups_per_call` groups per step; the reference, and the only
one for the vision suites), 'vllm' (rollout/vllm_engine.py: an in-process vLLM
engine, continuous batching, each group returned the step its last response ends) and
'vllm_server' (rollout/vllm_server_engine.py: a vLLM server the user runs on the
worker's host, over its HTTP API; weights through shared memory).

Every engine returns, per response, the sampled tokens (up to and including the stop
token), the log-probs of the distribution actually sampled (logits / temperature,
restricted to the top-p nucleus and renormalised), the finish reason and the first and
last weight version that produced its tokens.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # types only: this module does not load JAX
  from knittrans_jax.rollout.sampler import SamplerConfig

ENGINES = ("jax", "vllm", "vllm_server")


@dataclasses.dataclass(frozen=True)
class ToolInsert:
  """What a tool inserts into a response (multi-turn tasks): the first time the
  response samples `call_token`, the tokens `output` follow it, unsampled (log-prob 0,
  no loss on them), and sampling goes on from a context that holds them."""
  call_token: int
  output: np.ndarray  # int32 [K]


@dataclasses.dataclass(frozen=True)
class GroupRequest:
  """One GRPO group: n responses to one prompt. `seeds[i]` seeds response i on every
  engine (`response_seeds`). `image`: the group's one image, shared by its n responses
  (a VLM's float32 [S, S, 3]; for Qwen-VL the stored uint8 image, which
  EngineSpec.prompts.image_inputs processes). `tool`: what a tool inserts, if the
  task calls one."""
  group_id: int
  source: str
  prompt: np.ndarray  # int32 [P]
  n: int
  seeds: tuple[int, ...]
  image: np.ndarray | None = None
  tool: ToolInsert | None = None

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
class PromptSpec:
  """How the JAX sampler lays out a suite's prompts. `length`: prompts are left-padded
  to it (a fixed shape, one compilation; None: each call's longest prompt).
  `image_inputs`: Qwen-VL's processor of the requests' stored images (M-RoPE prefill);
  None: a request's image is a VLM's float image. `banned`: ids that belong in prompts
  only and are never sampled (the vision special tokens)."""
  length: int | None = None
  image_inputs: Any = None  # its `prefill` (multimodal/qwen_images.py's QwenImageInputs)
  banned: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """What a worker needs to build its engine. `model_config`: the decoder's
  DecoderConfig; `groups_per_call`: the 'jax' engine's static batch (groups per
  sampler call; JobConfig.groups_per_call), which the 'vllm' engine, batching
  continuously, does without; `rows_per_call`: instead, the 'jax' engine takes
  queued requests up to this many responses a call, padded to a power-of-two row
  count and prompt length (agentic turns, rollout/agent_loop.py: requests of n = 1
  whose contexts grow, in a few shapes compiled once); `options`: backend options
  (VllmOptions for 'vllm', VllmServerOptions for 'vllm_server'); `index`: the
  worker's (which of VllmServerOptions.urls is its server)."""
  name: str
  model_config: Any
  sampler: SamplerConfig
  seed: int
  groups_per_call: int | None = None
  options: Any = None
  workdir: str | None = None  # where an engine that loads from disk writes its weights
  prompts: PromptSpec = PromptSpec()
  rows_per_call: int | None = None
  index: int = 0

  def __post_init__(self):
    if self.name not in ENGINES:
      raise ValueError(f"rollout engine {self.name!r} is unknown; use one of {ENGINES}")
    if self.rows_per_call is not None and self.rows_per_call < 1:
      raise ValueError(f"EngineSpec.rows_per_call = {self.rows_per_call}: must be >= 1")
    if (self.name == "jax" and self.rows_per_call is None
        and (self.groups_per_call is None or self.groups_per_call < 1)):
      raise ValueError(f"EngineSpec.groups_per_call = {self.groups_per_call}: the 'jax' engine "
                       "needs its static batch (>= 1 groups per sampler call)")


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
  """Integer seeds of a group's n responses: a pure function of (seed, group id, i),
  the one seeding of a response (the JAX engine makes its key from the integer)."""
  state = np.random.SeedSequence([seed, group_id]).generate_state(n, np.uint32)
  return tuple(int(s) >> 1 for s in state)  # 31 bits: any engine's int seed takes them
