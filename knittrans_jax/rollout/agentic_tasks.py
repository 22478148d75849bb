"""The 'agentic' suite: multi-turn tool episodes with heavy-tailed turn counts and
tool latencies, learnable by the tiny model (its 64-id vocabulary, rollout/tasks.py).

  hop      prompt: BOS HOP k SEP. The environment holds a hidden hop count m in 1..8
           (P(m) proportional to m^-AgenticTaskConfig.turn_tail: most episodes take
           one or two turns, a few take eight). Each turn the agent calls the tool on
           the key it was last shown: CALL k EOS; the tool answers RESULT TABLE[k]
           SEP, the key of the next turn. After m calls the episode is done. Each
           turn scores (1/m) x (0.3 for CALL first + 0.7 x closeness of the key to the
           one last shown, max(0, 1 - |a - k| / 8), x 0.7 unless EOS follows it):
           copying the digit just shown is what it learns.
  nearest  one turn: rollout/tasks.py's 'nearest' task, scored by the environment
           and done (a short, tool-free source beside the long one).

The tool's latency is drawn per call from a log-normal (ToolLatency: median,
sigma, clipped to [min_s, max_s]) and the environment sleeps that long: an honest
stand-in for a sandbox or a search call, which costs wall time and no CPU. Every
draw (the task, m, each latency) is a pure function of the run's seed, the group
id and the episode, so a run is reproducible.
"""
from __future__ import annotations

import dataclasses
import time

import gin
import numpy as np

from knittrans_jax.data import split
from knittrans_jax.rollout import tasks
from knittrans_jax.rollout.environment import Environment, EnvStep

HOP = 11  # the hop task's marker (rollout/tasks.py leaves 11-15 free)
SOURCES = ("hop", "nearest")
PROMPT_LEN = 4
MAX_HOPS = 8


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ToolLatency:
  """A tool call's latency: log-normal with this median and sigma, clipped to
  [min_s, max_s]; median_s = 0: no sleep (tests of the path alone)."""
  median_s: float = 0.05
  sigma: float = 1.2
  min_s: float = 0.005
  max_s: float = 2.0

  def __post_init__(self):
    if self.median_s < 0 or self.sigma < 0 or not 0 <= self.min_s <= self.max_s:
      raise ValueError(f"ToolLatency: median_s {self.median_s} >= 0, sigma {self.sigma} >= 0 "
                       f"and 0 <= min_s {self.min_s} <= max_s {self.max_s} are required")

  def draw(self, rng: np.random.Generator) -> float:
    if self.median_s == 0:
      return 0.0
    return float(np.clip(self.median_s * np.exp(self.sigma * rng.standard_normal()),
                         self.min_s, self.max_s))


FAULTS = ("raise", "hang", "malformed")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AgenticTaskConfig:
  """turn_tail: the hop count's tail exponent (P(m) ~ m^-turn_tail on 1..8; 0:
  uniform); latency: the tool's (ToolLatency). fault_rate: fault injection, the
  share of training tool calls that fail, each one of FAULTS drawn evenly (the tool
  raises; hangs for hang_s, past AgentConfig.step_timeout_s; answers a token outside
  the vocabulary): the job's fault tests; never in held-out evaluation."""
  turn_tail: float = 1.5
  # Built with the config (at the root), so ToolLatency's gin bindings apply without
  # `AgenticTaskConfig.latency = @ToolLatency()`; a default built at import ignored them.
  latency: ToolLatency = dataclasses.field(default_factory=ToolLatency)
  fault_rate: float = 0.0
  hang_s: float = 30.0

  def __post_init__(self):
    if self.turn_tail < 0:
      raise ValueError(f"AgenticTaskConfig.turn_tail = {self.turn_tail}: must be >= 0")
    if not 0 <= self.fault_rate <= 1:
      raise ValueError(f"AgenticTaskConfig.fault_rate = {self.fault_rate}: must be in [0, 1]")

  def hop_probabilities(self) -> np.ndarray:
    p = np.arange(1, MAX_HOPS + 1, dtype=np.float64) ** -self.turn_tail
    return p / p.sum()


@dataclasses.dataclass(frozen=True)
class AgenticTask:
  """`hops`: the hidden turn count ('hop'); `inner`: the wrapped one-turn task
  ('nearest'); `latency_seed`: seeds the tool's latencies."""
  source: str
  prompt: np.ndarray
  hops: int = 1
  inner: tasks.Task | None = None
  latency_seed: tuple[int, ...] = ()


def make_task(rng: np.random.Generator, source: str, config: AgenticTaskConfig) -> AgenticTask:
  seed = tuple(int(x) for x in rng.integers(0, 2**31, 2))
  if source == "hop":
    k = int(rng.integers(0, 16))
    m = int(rng.choice(np.arange(1, MAX_HOPS + 1), p=config.hop_probabilities()))
    return AgenticTask(source, np.array([tasks.BOS, HOP, tasks.digit(k), tasks.SEP], np.int32),
                       hops=m, latency_seed=seed)
  if source == "nearest":
    inner = tasks.make_task(rng, "nearest")
    return AgenticTask(source, inner.prompt, inner=inner, latency_seed=seed)
  raise ValueError(f"unknown agentic task source {source!r}; choose one of {SOURCES}")


def held_out(task: AgenticTask) -> bool:
  """The split of data/split.py by the prompt the policy sees (not the hidden hop
  count: a held-out prompt is never trained on, whatever its episode's length)."""
  return split.held_out(task.source, task.prompt)


def turn_score(response: np.ndarray, key: int, hops: int) -> float:
  """One hop turn's reward (module doc)."""
  body, stopped = tasks.answer_body(np.asarray(response))
  if body.size == 0:
    return 0.0
  called = body[0] == tasks.CALL
  rest = body[1:] if called else body
  close = 0.0
  if rest.size and tasks.DIGIT0 <= rest[0] < tasks.DIGIT0 + 16:
    close = max(0.0, 1.0 - abs(int(rest[0]) - tasks.DIGIT0 - key) / 8.0)
    close *= 1.0 if (stopped and rest.size == 1) else 0.7
  return (0.3 * called + 0.7 * close) / hops


class AgenticEnv(Environment):
  """One episode of an AgenticTask; `episode` (0..n-1) seeds its tool latencies (and
  injected faults, where `faults`)."""
  name = "agentic"

  def __init__(self, task: AgenticTask, episode: int, config: AgenticTaskConfig,
               faults: bool = False):
    self.task, self.config = task, config
    self.fault_rate = config.fault_rate if faults else 0.0
    self.rng = np.random.default_rng([*task.latency_seed, episode])
    self.key = int(task.prompt[2]) - tasks.DIGIT0 if task.source == "hop" else 0
    self.turns = 0

  def reset(self, task) -> np.ndarray:
    return self.task.prompt

  def step(self, response: np.ndarray) -> EnvStep:
    self.turns += 1
    t = self.task
    if t.source == "nearest":
      return EnvStep(np.zeros(0, np.int32), tasks.score(t.inner, response), True)
    reward = turn_score(response, self.key, t.hops)
    time.sleep(self.config.latency.draw(self.rng))  # the tool call
    if self.fault_rate and self.rng.random() < self.fault_rate:
      fault = FAULTS[int(self.rng.integers(len(FAULTS)))]
      if fault == "raise":
        raise RuntimeError("injected tool fault (AgenticTaskConfig.fault_rate)")
      if fault == "hang":
        time.sleep(self.config.hang_s)
      else:
        return EnvStep(np.array([tasks.RESULT, tasks.VOCAB_SIZE], np.int32), reward, False)
    body, _ = tasks.answer_body(np.asarray(response))
    called = body[1:2] if body.size and body[0] == tasks.CALL else body[:1]
    asked = (int(called[0]) - tasks.DIGIT0 if called.size
             and tasks.DIGIT0 <= called[0] < tasks.DIGIT0 + 16 else self.key)
    self.key = tasks.TABLE[asked]  # what the tool returns: the next turn's key
    obs = np.array([tasks.RESULT, tasks.digit(self.key), tasks.SEP], np.int32)
    return EnvStep(obs, reward, self.turns >= t.hops, {"hops": t.hops})
