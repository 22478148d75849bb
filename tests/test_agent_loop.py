"""The agent loop (rollout/agent_loop.py) against scripted environments on the JAX
engine: turns, masks, versions and seeds exact; episodes interleave; every
environment fault fails its group, with the reason, and no other."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rl import token_logprobs
from knittrans_jax.rollout.agent_loop import (AgentConfig, AgentLoop, EpisodeGroup, FailedGroup,
                                              turn_seed)
from knittrans_jax.rollout.engine import EngineSpec
from knittrans_jax.rollout.environment import Environment, EnvStep
from knittrans_jax.rollout.jax_engine import JaxEngine, bucket
from knittrans_jax.rollout.sampler import SamplerConfig

CFG = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64)
SAMPLER = SamplerConfig(max_new_tokens=6, temperature=1.0, stop_tokens=(1,))


@pytest.fixture(scope="module")
def model():
  with nnx.use_eager_sharding(False):
    m = DecoderLM(CFG, nnx.Rngs(0))
  return nnx.split(m, nnx.Param)


def engine(model, rows=8):
  graphdef, params = model
  return JaxEngine(EngineSpec("jax", CFG, SAMPLER, 0, rows_per_call=rows), graphdef, params, 0)


class Scripted(Environment):
  """Prompt [2, 3, 16 + k]; `turns` steps, each answering [10, 16 + step] and reward
  0.25; `sleep` seconds per step; `fault` at step `fault_at` ('raise', 'hang',
  'nan', 'vocab', 'type')."""
  name = "scripted"

  def __init__(self, k=0, turns=3, sleep=0.0, fault=None, fault_at=1):
    self.k, self.turns, self.sleep, self.fault, self.fault_at = k, turns, sleep, fault, fault_at
    self.steps, self.closed, self.seen = 0, False, []

  def reset(self, task):
    return np.array([2, 3, 16 + self.k], np.int32)

  def step(self, response):
    self.steps += 1
    self.seen.append(np.asarray(response).copy())
    time.sleep(self.sleep)
    if self.fault and self.steps == self.fault_at:
      if self.fault == "raise":
        raise KeyError("the tool's table has no such key")
      if self.fault == "hang":
        time.sleep(1.0)
      if self.fault == "nan":
        return EnvStep(np.array([10], np.int32), float("nan"), False)
      if self.fault == "vocab":
        return EnvStep(np.array([10, 99], np.int32), 0.0, False)
      if self.fault == "type":
        return {"observation": [10], "reward": 0.0, "done": False}
    return EnvStep(np.array([10, 16 + self.steps], np.int32), 0.25, self.steps >= self.turns)

  def close(self):
    self.closed = True


def run(loop):
  out = loop.run()
  loop.close()
  return {g.group_id: g for g in out}


def test_episodes_are_exact(model):
  graphdef, params = model
  loop = AgentLoop(engine(model), AgentConfig(max_turns=8, max_tokens=64), vocab_size=64,
                   max_new_tokens=SAMPLER.max_new_tokens)
  envs = {g: [Scripted(k=g, turns=1 + i) for i in range(3)] for g in range(2)}
  seeds = {g: (11 + g, 22 + g, 33 + g) for g in range(2)}
  for g in range(2):
    loop.add(g, "s", envs[g], None, seeds[g])
  out = run(loop)
  assert sorted(out) == [0, 1]
  fwd = jax.jit(lambda t, v: token_logprobs(nnx.merge(graphdef, params)(t, v), t)[0])
  for g, group in out.items():
    assert isinstance(group, EpisodeGroup) and group.source == "s"
    for i, ep in enumerate(group.episodes):
      env = envs[g][i]
      assert env.closed and ep.end == "done" and len(ep.turns) == i + 1
      assert ep.reward == pytest.approx(0.25 * (i + 1))
      np.testing.assert_array_equal(ep.prompt, [2, 3, 16 + g])
      tokens, logprobs, mask = ep.response()
      # Each turn then its observation; the one after the last turn is dropped.
      want, k = [], 0
      for j, t in enumerate(ep.turns):
        np.testing.assert_array_equal(env.seen[j], t.tokens)
        obs = [] if j == len(ep.turns) - 1 else [10, 16 + j + 1]
        np.testing.assert_array_equal(t.observation, obs)
        assert t.versions == (0, 0) and t.finish_reason in ("stop", "length")
        want += [(t.tokens, True), (np.array(obs, np.int32), False)]
      np.testing.assert_array_equal(tokens, np.concatenate([w for w, _ in want]))
      np.testing.assert_array_equal(mask, np.concatenate([np.full(w.size, m) for w, m in want]))
      assert (logprobs[~mask] == 0).all() and (logprobs[mask] < 0).all()
      # Every turn's behaviour log-probs are the policy's over the whole episode: each
      # turn was sampled from exactly the context the trajectory stores.
      seq = np.concatenate([ep.prompt, tokens])
      ref = np.asarray(fwd(jnp.asarray(seq[None]), jnp.ones((1, seq.size), bool)))[0]
      np.testing.assert_allclose(logprobs[mask], ref[ep.prompt.size:][mask], atol=2e-5)
      # Turn 0 samples with the response's seed, later turns with turn_seed.
      assert turn_seed(seeds[g][i], 0) == seeds[g][i]
  assert len({turn_seed(5, k) for k in range(8)}) == 8


def test_seeds_make_episodes_reproducible_and_batching_free(model):
  """The same seeds give the same episodes whatever else shares the engine's calls."""
  def episodes(rows, extra):
    loop = AgentLoop(engine(model, rows), AgentConfig(), vocab_size=64,
                     max_new_tokens=SAMPLER.max_new_tokens)
    loop.add(0, "s", [Scripted(turns=3) for _ in range(2)], None, (5, 6))
    for g in range(1, 1 + extra):
      loop.add(g, "s", [Scripted(k=g, turns=2)], None, (100 + g,))
    return [ep.response()[0] for ep in run(loop)[0].episodes]

  alone, shared = episodes(1, 0), episodes(8, 5)
  for a, b in zip(alone, shared):
    np.testing.assert_array_equal(a, b)


def test_versions_per_turn(model):
  graphdef, params = model
  eng = engine(model)
  loop = AgentLoop(eng, AgentConfig(), vocab_size=64, max_new_tokens=SAMPLER.max_new_tokens)
  loop.add(0, "s", [Scripted(turns=3)], None, (1,))
  versions, out = 0, []
  while loop.busy:
    out += loop.step()
    if eng.busy is False and versions < 5:
      versions += 1
      eng.update_weights(versions, params)  # a new version between engine steps
  ep = out[0].episodes[0]
  got = [t.versions for t in ep.turns]
  assert [a for a, b in got] == sorted(a for a, b in got) and all(a == b for a, b in got)
  assert ep.versions == tuple(sorted({a for a, _ in got}))
  assert len(ep.versions) > 1  # the weights changed between turns
  # What the store keeps of each turn: where it lies in the response, its versions.
  _, _, mask = ep.response()
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
  spans = ep.turn_spans()
  assert [(s.start, s.end) for s in spans] == list(zip(edges[0::2], edges[1::2]))
  assert [(s.version_first, s.version_last) for s in spans] == got


def test_budget_and_max_turns_end_an_episode(model):
  loop = AgentLoop(engine(model), AgentConfig(max_turns=2, max_tokens=64), vocab_size=64,
                   max_new_tokens=SAMPLER.max_new_tokens)
  loop.add(0, "s", [Scripted(turns=5)], None, (1,))
  assert run(loop)[0].episodes[0].end == "max_turns"
  # Room for the prompt (3), one turn (<= 6) and its observation (2), not a second turn.
  loop = AgentLoop(engine(model), AgentConfig(max_tokens=3 + 6 + 2 + 5), vocab_size=64,
                   max_new_tokens=SAMPLER.max_new_tokens)
  loop.add(0, "s", [Scripted(turns=5)], None, (1,))
  ep = run(loop)[0].episodes[0]
  assert ep.end == "budget" and len(ep.turns) == 1 and ep.turns[0].observation.size == 0
  with pytest.raises(ValueError, match="AgentConfig.max_turns = 0"):
    AgentConfig(max_turns=0)


class Finishing(Scripted):
  """Counts its episode's last step into `done`; the 8th sets `all_done`."""

  def __init__(self, done, all_done, **kw):
    super().__init__(**kw)
    self.done, self.all_done = done, all_done

  def step(self, response):
    out = super().step(response)
    if out.done:
      with self.done["lock"]:
        self.done["n"] += 1
        if self.done["n"] == 8:
          self.all_done.set()
    return out


class Waiting(Scripted):
  """A step that lasts until every fast episode has ended (at most 20 s), then 1 s."""

  def __init__(self, all_done, **kw):
    super().__init__(**kw)
    self.all_done = all_done

  def step(self, response):
    self.all_done.wait(20.0)  # under AgentConfig.step_timeout_s (30)
    time.sleep(1.0)  # the last fast group's bookkeeping, which generates nothing
    return super().step(response)


def test_a_slow_environment_does_not_hold_the_engine(model):
  """One group's environment step lasts until the others' groups (four turns each)
  have all ended: they end while it waits, and it still ends whole. Held on events,
  not a sleep, so a loaded machine cannot fail it; an engine held by the slow step
  would let no fast episode end, and the slow group would end first, after 20 s."""
  import threading
  eng = engine(model)
  all_done, done = threading.Event(), {"n": 0, "lock": threading.Lock()}
  loop = AgentLoop(eng, AgentConfig(), vocab_size=64, max_new_tokens=SAMPLER.max_new_tokens)
  loop.add(0, "slow", [Waiting(all_done, turns=1)], None, (1,))
  for g in range(1, 5):
    loop.add(g, "fast", [Finishing(done, all_done, k=g, turns=4) for _ in range(2)], None,
             (g, 10 + g))
  order = [g.group_id for g in loop.run()]
  loop.close()
  assert all_done.is_set() and order[-1] == 0 and sorted(order) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("fault,match", [
    ("raise", r"step 1 \(turn\): raised KeyError"),
    ("hang", r"no answer within AgentConfig.step_timeout_s = 0.5 s"),
    ("nan", r"reward: a finite number expected, got nan"),
    ("vocab", r"observation: token id 99 is outside the vocabulary \[0, 64\)"),
    ("type", r"step returned dict, not an EnvStep"),
])
def test_environment_faults_fail_their_group_only(model, fault, match):
  loop = AgentLoop(engine(model), AgentConfig(step_timeout_s=0.5), vocab_size=64,
                   max_new_tokens=SAMPLER.max_new_tokens)
  bad = [Scripted(turns=3), Scripted(turns=3, fault=fault, fault_at=2)]
  loop.add(7, "bad", bad, None, (1, 2))
  loop.add(8, "good", [Scripted(turns=3) for _ in range(2)], None, (3, 4))
  out = run(loop)
  assert isinstance(out[7], FailedGroup) and out[7].source == "bad"
  assert "environment 'scripted', step 2" in out[7].reason and "group 7" in out[7].reason
  assert __import__("re").search(match.replace("step 1", "step 2"), out[7].reason), out[7].reason
  deadline = time.time() + 2.0  # a hung environment closes once its call returns
  while not all(e.closed for e in bad) and time.time() < deadline:
    time.sleep(0.05)
  assert all(e.closed for e in bad)
  assert isinstance(out[8], EpisodeGroup) and all(len(e.turns) == 3 for e in out[8].episodes)


def test_bad_prompts_and_groups():
  class Long(Scripted):
    def reset(self, task):
      return np.arange(2, 62, dtype=np.int32)

  loop = AgentLoop(_NoEngine(), AgentConfig(max_tokens=64), vocab_size=64, max_new_tokens=6)
  loop.add(0, "s", [Long()], None, (1,))
  (out,) = loop.run()
  assert "a prompt of 60 tokens leaves no room" in out.reason
  with pytest.raises(ValueError, match="group 0: 2 environments for 1 seeds"):
    loop.add(0, "s", [Scripted(), Scripted()], None, (1,))


class _NoEngine:
  busy = False

  def add(self, requests):
    raise AssertionError("no turn should start")


def test_row_buckets_compile_few_shapes(model):
  assert [bucket(n) for n in (1, 8, 9, 17, 64)] == [16, 16, 16, 32, 64]
  assert [bucket(n, least=4) for n in (1, 5, 8)] == [4, 8, 8]
  eng = engine(model, rows=8)
  loop = AgentLoop(eng, AgentConfig(), vocab_size=64, max_new_tokens=SAMPLER.max_new_tokens)
  for g in range(6):
    loop.add(g, "s", [Scripted(k=g, turns=1 + g % 4) for _ in range(3)], None, (g, g + 9, g + 18))
  out = run(loop)
  assert len(out) == 6
  # Row counts 1..8 and contexts 3..26 tokens: 2 row buckets (4, 8) x 2 length
  # buckets (16, 32); compile_shapes then runs every shape up to 32 tokens, no more.
  assert eng.compiled_shapes <= 4
  assert eng.compile_shapes(32) == 4 and eng.compiled_shapes == 4


def test_a_failed_groups_turns_are_drained_and_never_reach_a_new_group(model):
  """Episode 0's environment raises while episode 1's turn is in the engine: the loop
  stays busy until the engine returns that turn, discards it, and a group added
  again under the same id gets only its own turns."""
  class Slow(Scripted):
    def reset(self, task):
      time.sleep(0.3)  # its first turn starts after the other episode's fails
      return super().reset(task)

  loop = AgentLoop(engine(model), AgentConfig(), vocab_size=64,
                   max_new_tokens=SAMPLER.max_new_tokens)
  loop.add(7, "s", [Scripted(turns=3, fault="raise", fault_at=1), Slow(turns=3)], None, (1, 2))
  out = []
  while not out:
    out += loop.step()
  assert isinstance(out[0], FailedGroup)
  while loop.busy:  # the other episode's turn comes back and is dropped
    assert loop.step() == []
  assert not loop._turns and not loop.engine.busy
  fresh = [Scripted(turns=2)]
  loop.add(7, "s", fresh, None, (5,))
  (again,) = loop.run()
  loop.close()
  assert isinstance(again, EpisodeGroup) and len(again.episodes[0].turns) == 2
  assert [len(x) for x in fresh[0].seen] == [t.tokens.size for t in again.episodes[0].turns]


def test_calls_that_cannot_start_time_out_and_envs_close_once_after_their_call(model):
  """One environment thread, held by a hung call: the next group's reset cannot start
  and fails after the timeout too; a hung environment is closed only once its call
  returns, and exactly once."""
  class Hang(Scripted):
    closes = 0

    def reset(self, task):
      time.sleep(1.0)
      return super().reset(task)

    def close(self):
      assert self.returned, "closed while its call was still running"
      Hang.closes += 1

    @property
    def returned(self):
      return self._returned

  class Hang2(Hang):
    _returned = False

    def reset(self, task):
      out = super().reset(task)
      self._returned = True
      return out

  loop = AgentLoop(engine(model), AgentConfig(step_timeout_s=0.3, env_threads=1), vocab_size=64,
                   max_new_tokens=SAMPLER.max_new_tokens)
  hung = Hang2()
  loop.add(0, "hung", [hung], None, (1,))
  loop.add(1, "queued", [Scripted()], None, (2,))
  out = {g.group_id: g for g in loop.run()}
  assert "no answer within AgentConfig.step_timeout_s = 0.3 s" in out[0].reason
  assert "no free environment thread" in out[1].reason
  time.sleep(1.0)
  assert Hang.closes == 1
  loop.close()
