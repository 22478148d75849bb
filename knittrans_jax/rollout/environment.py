"""The environment interface of agentic rollouts, at the token level.

    env = suite.environment(task)          # one per episode
    prompt = env.reset(task)               # int32 prompt ids
    step = env.step(response)              # the turn's sampled ids, stop token included
    step.observation, step.reward, step.done, step.info

An episode alternates a generated turn and an environment step until the
environment says `done` (or the agent loop's turn or token budget ends it). The
observation's tokens are appended to the context the next turn is generated from;
they are context, not the policy's, so they carry loss mask 0 (rollout/agent_loop.py).
The episode's reward is the sum of its steps' rewards.

`reset` and `step` may take wall time (a sandbox, a search call, a user): the agent
loop runs them on a thread pool, off the engine's thread, under a per-step timeout.
An environment keeps whatever state an episode needs; one instance serves one
episode and is then `close`d. Text environments (OpenAI-style messages in, text out)
come in through an adapter that owns a tokenizer (rollout/skyrl_env.py).
"""
from __future__ import annotations

import abc
import concurrent.futures as cf
import dataclasses
import time
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class EnvStep:
  """What one environment step returns. `observation`: int32 [K] token ids appended
  to the context before the next turn (K may be 0); `reward`: this step's reward;
  `done`: the episode ends here (the observation is then not appended)."""
  observation: np.ndarray
  reward: float
  done: bool
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


class EnvironmentError(RuntimeError):
  """An environment failed an episode: it raised, timed out or returned what the loop
  cannot use. `env` names the environment, `step` the step (0: reset)."""

  def __init__(self, env: str, step: int, reason: str):
    super().__init__(f"environment {env!r}, step {step} ({'reset' if step == 0 else 'turn'}): "
                     f"{reason}")
    self.env, self.step, self.reason = env, step, reason


class Environment(abc.ABC):
  """One episode's environment. `name` is what errors and metrics call it."""

  name: str = "environment"
  # A pure, instant environment (a single-turn task's scorer): the agent loop calls
  # it on its own thread, not the pool, so a step sends every ready episode at once.
  inline: bool = False

  @abc.abstractmethod
  def reset(self, task) -> np.ndarray:
    """The episode's prompt: int32 token ids."""

  @abc.abstractmethod
  def step(self, response: np.ndarray) -> EnvStep:
    """The environment's answer to one generated turn (int32 ids, as sampled)."""

  def close(self) -> None:
    pass


def checked_ids(env: str, step: int, field: str, ids, vocab_size: int | None) -> np.ndarray:
  """`ids` as a 1-D int32 array, or an EnvironmentError naming the field and the value."""
  a = np.asarray(ids)
  if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
    raise EnvironmentError(env, step, f"{field}: 1-D integer token ids expected, got "
                           f"{a.dtype} {a.shape}")
  if a.size and (a.min() < 0 or (vocab_size is not None and a.max() >= vocab_size)):
    bad = int(a.min()) if a.min() < 0 else int(a.max())
    raise EnvironmentError(env, step, f"{field}: token id {bad} is outside the vocabulary "
                           f"[0, {vocab_size})")
  return a.astype(np.int32)


def checked_step(env: str, step: int, out, vocab_size: int | None) -> EnvStep:
  """A step's result checked: an EnvStep with int ids, a finite reward and a bool done."""
  if not isinstance(out, EnvStep):
    raise EnvironmentError(env, step, f"step returned {type(out).__name__}, not an EnvStep")
  reward = out.reward
  if not isinstance(reward, (int, float, np.floating, np.integer)) or not np.isfinite(reward):
    raise EnvironmentError(env, step, f"reward: a finite number expected, got {reward!r}")
  if not isinstance(out.done, (bool, np.bool_)):
    raise EnvironmentError(env, step, f"done: a bool expected, got {out.done!r}")
  obs = checked_ids(env, step, "observation", out.observation, vocab_size)
  return EnvStep(obs, float(reward), bool(out.done), dict(out.info or {}))


def is_inline(env: Environment) -> bool:
  """Whether the environment's calls run on the caller's thread (Environment.inline)."""
  return bool(getattr(env, "inline", False))


class _Done:
  """An inline call's outcome, read as the loop reads a done Future."""

  def __init__(self, value, error: Exception | None = None):
    self.value, self.error = value, error

  def done(self) -> bool:
    return True

  def result(self):
    if self.error is not None:
      raise self.error
    return self.value


class EnvCall:
  """An environment call on the pool; `started` is set when a thread runs it. An
  `inline` environment's call runs here, on the caller's thread (a pure scorer)."""

  def __init__(self, pool: cf.ThreadPoolExecutor, fn: Callable, *args, inline: bool = False):
    self.submitted, self.started = time.perf_counter(), None
    self.seconds = 0.0
    if inline:  # a finished call: no Future's lock and condition per episode
      self.started = self.submitted
      try:
        self.future = _Done(fn(*args))
      except Exception as e:  # noqa: BLE001 (named by the loop, as a pooled call's)
        self.future = _Done(None, e)
      self.seconds = time.perf_counter() - self.started
      return

    def run():
      self.started = time.perf_counter()
      try:
        return fn(*args)
      finally:
        self.seconds = time.perf_counter() - self.started

    self.future = pool.submit(run)
