"""Multi-turn episodes over a rollout engine: generate a turn, step the environment,
append its observation, generate again, until the environment says done.

    loop = AgentLoop(engine, AgentConfig(), vocab_size=64, max_new_tokens=8)
    loop.add(group_id, source, [env_0, ..., env_{n-1}], task, seeds)   # one GRPO group
    while loop.busy:
      for out in loop.step():      # EpisodeGroup (all n episodes ended) or FailedGroup
        ...

Many episodes run at once on one engine: each turn is one engine request (n = 1,
its context as the prompt), so while some episodes wait on their environments the
others generate; on vLLM every turn joins the continuous batch and the prefix cache
serves the context a turn shares with the previous one, on the JAX engine the
turns ready at a step are decoded together. Environment calls (`reset`, `step`) run
on a thread pool under `AgentConfig.step_timeout_s`, never on the engine's thread.

An episode ends when the environment says done, after `max_turns` turns, or when
its context could not hold another full turn within `max_tokens`. The episode is
one trajectory: its prompt, then every turn and the observation that followed it
(the observation after the last turn is dropped: nothing was generated from it).
Observation tokens carry log-prob 0 and loss mask 0. Turn k of episode i samples
with a seed derived from the group's seed i and k (turn 0 with seed i itself, so a
one-turn episode samples what the single-turn path samples).

A group is reported when its last episode ends; one failed episode (the environment
raised, timed out or returned what the loop cannot use) fails its group, with the
reason, and the group's other turns are discarded as they come back.

Single-turn tasks are episodes of one step (suites/base.py's OneStepEnv), `inline`
environments (pure scorers) called on the loop's thread, so every group added before
a `step` is sent in it. A group's `tool` (the engine inserts its output mid-response,
rollout/tasks.py's 'lookup') goes with its requests; inserted tokens get loss mask 0.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from typing import Any

import gin
import numpy as np

from knittrans_jax.rollout.engine import GroupRequest, RolloutEngine, ToolInsert
from knittrans_jax.types import TurnSpan
from knittrans_jax.rollout.environment import (EnvCall, Environment, EnvironmentError,
                                               checked_ids, checked_step, is_inline)

WAIT_S = 0.05  # an idle engine waits on environments at most this long per step()


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """max_turns: generated turns per episode at most; max_tokens: an episode's context
  (prompt, turns, observations) at most, so a turn starts only if its context plus
  SamplerConfig.max_new_tokens fits; step_timeout_s: one environment call (reset or
  step) at most, from when it starts running; env_threads: environment calls running
  at once (a call that hangs past its timeout keeps its thread until it returns)."""
  max_turns: int = 8
  max_tokens: int = 256
  step_timeout_s: float = 30.0
  env_threads: int = 64

  def __post_init__(self):
    for name in ("max_turns", "max_tokens", "env_threads"):
      if getattr(self, name) < 1:
        raise ValueError(f"AgentConfig.{name} = {getattr(self, name)}: must be >= 1")
    if not self.step_timeout_s > 0:
      raise ValueError(f"AgentConfig.step_timeout_s = {self.step_timeout_s}: must be > 0")


def turn_seed(seed: int, turn: int) -> int:
  """The seed of an episode's turn `turn`, from its response seed: turn 0 is the seed
  itself; later turns a pure function of (seed, turn), 31 bits like response_seeds."""
  if turn == 0:
    return seed
  return int(np.random.SeedSequence([seed, turn]).generate_state(1, np.uint32)[0]) >> 1


@dataclasses.dataclass(frozen=True)
class Turn:
  """One generated turn: its tokens (the stop token included) and behaviour log-probs,
  the (first, last) weight version that generated them, the observation the
  environment answered with (empty after the last turn) and the seconds the turn's
  engine request (from sent to answered: waiting behind other episodes' turns
  included, as the episode waits) and its environment step took; `inserted` the
  tokens a tool inserted mid-turn (None: none), `engine_s` the engine's own time for
  the request (FinishedGroup.seconds: None when it included compilation)."""
  tokens: np.ndarray
  logprobs: np.ndarray
  versions: tuple[int, int]
  finish_reason: str
  observation: np.ndarray
  gen_s: float
  env_s: float
  inserted: np.ndarray | None = None
  engine_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Episode:
  """One episode: `end` is 'done' (the environment), 'max_turns' or 'budget'
  (AgentConfig.max_tokens); `reward` the sum of its steps' rewards; `env_s` includes
  the reset."""
  prompt: np.ndarray
  turns: tuple[Turn, ...]
  reward: float
  end: str
  env_s: float
  info: dict

  @property
  def gen_s(self) -> float:
    return sum(t.gen_s for t in self.turns)

  def response(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The trajectory's response: tokens, behaviour log-probs (0 on observations) and
    loss mask (False on observations), turns and observations in order."""
    toks, lps, mask = [], [], []
    for t in self.turns:
      toks += [t.tokens, t.observation]
      lps += [t.logprobs, np.zeros(t.observation.size, np.float32)]
      mask += [np.ones(t.tokens.size, bool) if t.inserted is None
               else ~np.asarray(t.inserted, bool), np.zeros(t.observation.size, bool)]
    return (np.concatenate(toks).astype(np.int32), np.concatenate(lps).astype(np.float32),
            np.concatenate(mask))

  @property
  def versions(self) -> tuple[int, ...]:
    return tuple(sorted({v for t in self.turns for v in t.versions}))

  def turn_spans(self) -> tuple[TurnSpan, ...]:
    """Where each turn lies in `response()` and the versions that generated it."""
    spans, pos = [], 0
    for t in self.turns:
      spans.append(TurnSpan(pos, pos + t.tokens.size, *t.versions))
      pos += t.tokens.size + t.observation.size
    return tuple(spans)


@dataclasses.dataclass(frozen=True)
class EpisodeGroup:
  """A group whose n episodes all ended; `seconds`: from its `add` to its last end;
  `image`: the one its requests carried (the store keeps it once)."""
  group_id: int
  source: str
  episodes: tuple[Episode, ...]
  seconds: float
  image: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class FailedGroup:
  group_id: int
  source: str
  reason: str


@dataclasses.dataclass
class _Episode:
  env: Environment
  seed: int
  context: list[int] = dataclasses.field(default_factory=list)
  prompt: np.ndarray | None = None
  turns: list[Turn] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  env_s: float = 0.0
  call: EnvCall | None = None  # the environment call in flight
  generating: bool = False  # a turn is in the engine
  # the turn the call answers: (tokens, logprobs, versions, reason, gen_s, inserted, engine_s)
  pending: tuple | None = None
  end: str | None = None
  info: dict = dataclasses.field(default_factory=dict)
  closed: bool = False


@dataclasses.dataclass
class _Group:
  group_id: int
  source: str
  task: Any
  episodes: list[_Episode]
  added: float
  seq: int  # which add this is (a turn of an earlier group of the same id is not ours)
  image: np.ndarray | None = None
  tool: ToolInsert | None = None


class AgentLoop:
  """Episodes of many groups over one engine (module doc). Not thread-safe: one caller
  drives add and step; the environments run on the loop's own threads."""

  def __init__(self, engine: RolloutEngine, config: AgentConfig, *, vocab_size: int | None,
               max_new_tokens: int):
    self.engine, self.config = engine, config
    self.vocab_size, self.max_new_tokens = vocab_size, max_new_tokens
    self.pool = cf.ThreadPoolExecutor(config.env_threads, thread_name_prefix="env")
    self.groups: dict[int, _Group] = {}
    # engine request id -> (group id, its add's seq, episode, when sent); a failed
    # group's turns stay here until the engine returns them, and are then discarded.
    self._turns: dict[int, tuple[int, int, int, float]] = {}
    self._next_request = self._adds = 0
    # Seconds the engine stepped; the loop stepped while the engine had turns (work_s);
    # the loop had episodes in flight (active_s).
    self.engine_s = self.work_s = self.active_s = 0.0
    self._since: float | None = None

  # ---- the caller's side ----------------------------------------------------------
  def add(self, group_id: int, source: str, envs: list[Environment], task,
          seeds: tuple[int, ...], image: np.ndarray | None = None,
          tool: ToolInsert | None = None) -> None:
    """Starts one group: episode i in environment envs[i], sampling with seeds[i];
    `image` and `tool` go with each of its requests (GroupRequest)."""
    if group_id in self.groups:
      raise ValueError(f"group {group_id} is already in the agent loop")
    if len(envs) != len(seeds):
      raise ValueError(f"group {group_id}: {len(envs)} environments for {len(seeds)} seeds")
    self._adds += 1
    g = _Group(group_id, source, task, [_Episode(e, s) for e, s in zip(envs, seeds)],
               time.perf_counter(), self._adds, image, tool)
    self.groups[group_id] = g
    for ep in g.episodes:
      ep.call = EnvCall(self.pool, ep.env.reset, task, inline=is_inline(ep.env))
    if self._since is None:
      self._since = time.perf_counter()

  @property
  def busy(self) -> bool:
    """Groups in flight, or turns of failed groups still in the engine."""
    return bool(self.groups or self._turns)

  @property
  def busy_fraction(self) -> float | None:
    """The engine's share of the wall time in which it had turns to generate: 1 when
    no turn ever waits behind an environment or the loop's own bookkeeping."""
    return self.engine_s / self.work_s if self.work_s > 0 else None

  @property
  def utilization(self) -> float | None:
    """The engine's share of all the wall time episodes were in flight: below 1 also
    when every episode waits on its environment (too few in flight for the tools'
    latency), which no loop can fill."""
    active = self.active_s + (time.perf_counter() - self._since if self._since else 0.0)
    return self.engine_s / active if active > 0 else None

  def step(self) -> list[EpisodeGroup | FailedGroup]:
    """One round: environment answers taken, ready turns sent, one engine step (or,
    with the engine idle, a short wait on the environments). Returns the groups that
    ended in it."""
    start = time.perf_counter()
    out = self._take_env_answers()
    self._send_turns()
    if self.engine.busy:
      t0 = time.perf_counter()
      finished = self.engine.step()
      self.engine_s += time.perf_counter() - t0
      for fg in finished:
        self._turn_done(fg)
      self.work_s += time.perf_counter() - start
    else:
      calls = [ep.call.future for g in self.groups.values() for ep in g.episodes
               if ep.call is not None and isinstance(ep.call.future, cf.Future)]
      if calls:
        cf.wait(calls, timeout=min(WAIT_S, self._next_deadline()),
                return_when=cf.FIRST_COMPLETED)
    out += self._take_env_answers()
    out += self._ended()
    if not self.busy and self._since is not None:
      self.active_s += time.perf_counter() - self._since
      self._since = None
    return out

  def run(self) -> list[EpisodeGroup | FailedGroup]:
    """Steps until every added group ended; the groups in the order they ended."""
    out = []
    while self.busy:
      out += self.step()
    return out

  def close(self) -> None:
    for g in self.groups.values():
      for ep in g.episodes:
        self._close_env(ep)
    self.groups.clear()
    self.pool.shutdown(wait=False, cancel_futures=True)

  # ---- environments ---------------------------------------------------------------
  def _next_deadline(self) -> float:
    now, left = time.perf_counter(), WAIT_S
    for g in self.groups.values():
      for ep in g.episodes:
        c = ep.call
        if c is not None and c.started is not None:
          left = min(left, max(0.0, c.started + self.config.step_timeout_s - now))
    return left

  def _take_env_answers(self) -> list[FailedGroup]:
    failed = []
    now = time.perf_counter()
    for g in list(self.groups.values()):
      for ep in g.episodes:
        c = ep.call
        if c is None:
          continue
        step = len(ep.turns) + (ep.pending is not None)  # 0: reset
        if not c.future.done():
          timeout = self.config.step_timeout_s
          if c.started is not None and now - c.started > timeout:
            failed.append(self._fail(g, EnvironmentError(
                ep.env.name, step, f"no answer within AgentConfig.step_timeout_s = {timeout:g} s")))
            break
          if c.started is None and now - c.submitted > timeout:  # hung calls hold every thread
            failed.append(self._fail(g, EnvironmentError(
                ep.env.name, step, f"no free environment thread for {timeout:g} s (all "
                f"AgentConfig.env_threads = {self.config.env_threads} busy: calls that hang "
                "past their timeout keep theirs)")))
            break
          continue
        ep.call, ep.env_s = None, ep.env_s + c.seconds
        try:
          self._answer(ep, step, c.future.result(), c.seconds)
        except EnvironmentError as e:
          failed.append(self._fail(g, e))
          break
        except Exception as e:  # noqa: BLE001 (the environment's own error, named)
          failed.append(self._fail(g, EnvironmentError(ep.env.name, step,
                                                       f"raised {type(e).__name__}: {e}")))
          break
    return failed

  def _answer(self, ep: _Episode, step: int, result, seconds: float) -> None:
    name, cfg = ep.env.name, self.config
    if ep.pending is None:  # the reset's prompt
      ep.prompt = checked_ids(name, 0, "prompt", result, self.vocab_size)
      if ep.prompt.size == 0:
        raise EnvironmentError(name, 0, "reset returned an empty prompt")
      if ep.prompt.size + self.max_new_tokens > cfg.max_tokens:
        raise EnvironmentError(name, 0, f"a prompt of {ep.prompt.size} tokens leaves no room for "
                               f"a turn of SamplerConfig.max_new_tokens = {self.max_new_tokens} "
                               f"within AgentConfig.max_tokens = {cfg.max_tokens}")
      ep.context = ep.prompt.tolist()
      return
    tokens, logprobs, versions, reason, gen_s, inserted, engine_s = ep.pending
    ep.pending = None
    got = checked_step(name, step, result, self.vocab_size)
    ep.reward += got.reward
    ep.info = got.info
    last = (got.done or len(ep.turns) + 1 >= cfg.max_turns
            or len(ep.context) + tokens.size + got.observation.size + self.max_new_tokens
            > cfg.max_tokens)
    obs = np.zeros(0, np.int32) if last else got.observation
    ep.turns.append(Turn(tokens, logprobs, versions, reason, obs, gen_s, seconds, inserted,
                         engine_s))
    if not last:  # the context a next turn starts from (an ended episode needs none)
      ep.context += tokens.tolist() + obs.tolist()
    else:
      ep.end = ("done" if got.done else "max_turns" if len(ep.turns) >= cfg.max_turns
                else "budget")
      self._close_env(ep)

  def _close_env(self, ep: _Episode) -> None:
    """Closes the episode's environment once, and never under a call still running
    on a pool thread (then when that call returns)."""
    if ep.closed:
      return
    ep.closed = True

    def close(_=None):
      try:
        ep.env.close()
      except Exception:  # noqa: BLE001 (the episode's data is already taken)
        pass

    if ep.call is not None and not ep.call.future.done():
      ep.call.future.add_done_callback(close)
    else:
      close()

  def _fail(self, g: _Group, e: EnvironmentError) -> FailedGroup:
    del self.groups[g.group_id]
    for ep in g.episodes:
      self._close_env(ep)
    return FailedGroup(g.group_id, g.source, f"group {g.group_id} (source {g.source!r}): {e}")

  # ---- turns ----------------------------------------------------------------------
  def _send_turns(self) -> None:
    requests = []
    for g in self.groups.values():
      for i, ep in enumerate(g.episodes):
        if ep.call is None and ep.end is None and ep.prompt is not None and not ep.generating:
          rid = self._next_request
          self._next_request += 1
          self._turns[rid] = (g.group_id, g.seq, i, time.perf_counter())
          ep.generating = True
          requests.append(GroupRequest(rid, g.source, np.asarray(ep.context, np.int32), 1,
                                       (turn_seed(ep.seed, len(ep.turns)),), image=g.image,
                                       tool=g.tool))
    if requests:
      self.engine.add(requests)

  def _turn_done(self, fg) -> None:
    gid, seq, i, sent = self._turns.pop(fg.request.group_id)
    g = self.groups.get(gid)
    if g is None or g.seq != seq:
      return  # the group failed meanwhile: its turns are discarded
    ep, r = g.episodes[i], fg.responses[0]
    ep.generating = False
    ep.pending = (np.asarray(r.tokens, np.int32), np.asarray(r.logprobs, np.float32),
                  tuple(r.versions), r.finish_reason, time.perf_counter() - sent, r.inserted,
                  fg.seconds)
    ep.call = EnvCall(self.pool, ep.env.step, ep.pending[0], inline=is_inline(ep.env))

  def _ended(self) -> list[EpisodeGroup]:
    out = []
    for g in list(self.groups.values()):
      if all(ep.end is not None for ep in g.episodes):
        del self.groups[g.group_id]
        out.append(EpisodeGroup(g.group_id, g.source, tuple(
            Episode(ep.prompt, tuple(ep.turns), ep.reward, ep.end, ep.env_s, ep.info)
            for ep in g.episodes), time.perf_counter() - g.added, g.image))
    return out

