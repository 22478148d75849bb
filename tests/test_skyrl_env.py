"""The skyrl-gym adapter (rollout/skyrl_env.py) on skyrl-gym's multi-turn GSM8K env and a
tiny Qwen-template tokenizer: the token sequence it builds is the chat template's
rendering of the whole conversation, and the env's rewards and done pass through."""
import sys

import numpy as np
import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

from hf_helpers import make_tokenizer
from knittrans_jax.data.tokenizer import Tokenizer
from knittrans_jax.rollout.environment import EnvironmentError
from knittrans_jax.rollout.skyrl_env import SkyrlEnv, TextTask, skyrl_environment

QUESTION = "Natalia sold 48 clips in April and half as many in May. How many in all?"
TASK = TextTask("gsm8k", ({"role": "user", "content": QUESTION},),
                {"reward_spec": {"ground_truth": "72"}, "max_turns": 3})
FORMAT = 0.2 / 3  # GSM8kMultiTurnEnv: a well-formed wrong answer, per turn


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tok"))
  make_tokenizer(path, [QUESTION, "48 / 2 = 24, 48 + 24 = 72\n#### 72", "#### 70",
                        "Please provide your step-by-step reasoning, and also include a "
                        "tentative numeric answer at the end in the exact format: '#### "
                        "ANSWER'.", "Now provide only the final numeric answer"])
  return Tokenizer.from_dir(path)


def turn(tok, text, stop=True):
  return np.asarray(tok.encode(text) + ([tok.stop_ids[0]] if stop else []), np.int32)


def play(env, tok, texts, stop=True):
  """Plays `texts` as turns; returns (ids, conversation, steps)."""
  ids = list(env.reset(TASK))
  conversation = [dict(m) for m in TASK.messages]
  steps = []
  for text in texts:
    t = turn(tok, text, stop)
    step = env.step(t)
    ids += list(t) + list(step.observation)
    conversation.append({"role": "assistant", "content": text})
    steps.append(step)
    if not step.done:  # the observation messages are what the env's next prompt holds
      conversation += env.messages[len(conversation):]
      # The invariant: the context is the template's rendering of the conversation.
      assert ids == tok.chat(conversation, add_generation_prompt=True)
  return ids, conversation, steps


def test_reset_is_the_chat_templated_prompt(tok):
  env = skyrl_environment("gsm8k_multi_turn", TASK, tok)
  prompt = env.reset(TASK)
  assert prompt.dtype == np.int32
  assert list(prompt) == tok.chat(list(TASK.messages), add_generation_prompt=True)
  assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
  assert env.name == "gsm8k_multi_turn"


def test_wrong_then_right_answer(tok):
  env = skyrl_environment("gsm8k_multi_turn", TASK, tok)
  ids, conversation, steps = play(env, tok, ["It is 70.\n#### 70",
                                             "48 / 2 = 24, 48 + 24 = 72\n#### 72"])
  assert [s.reward for s in steps] == [pytest.approx(FORMAT), 1.0]
  assert [s.done for s in steps] == [False, True]
  assert steps[1].observation.size == 0  # nothing follows the last turn
  assert env.messages == conversation  # the last turn is in the conversation too
  first = tok.decode(steps[0].observation, skip_special_tokens=False)
  assert first.startswith("\n<|im_start|>user\nPlease provide your step-by-step reasoning")
  assert first.endswith("<|im_end|>\n<|im_start|>assistant\n")
  # The whole episode: the template's rendering, up to the last turn's end-of-turn token.
  whole = tok.render_chat(conversation, add_generation_prompt=False)
  assert ids == tok.encode(whole.removesuffix("\n"))


def test_done_after_max_turns(tok):
  env = skyrl_environment("gsm8k_multi_turn", TASK, tok)
  _, conversation, steps = play(env, tok, ["#### 70", "no idea", "#### 71"])
  assert [s.reward for s in steps] == [pytest.approx(FORMAT), 0, pytest.approx(FORMAT)]
  assert [s.done for s in steps] == [False, False, True]
  assert conversation[-2]["content"].startswith("Now provide only the final numeric answer")


def test_truncated_turn_gets_the_end_of_turn_in_the_observation(tok):
  env = skyrl_environment("gsm8k_multi_turn", TASK, tok)
  ids, _, steps = play(env, tok, ["#### 70 because", "#### 72"], stop=False)
  assert [s.reward for s in steps] == [pytest.approx(FORMAT), 1.0]
  first = tok.decode(steps[0].observation, skip_special_tokens=False)
  assert first.startswith("<|im_end|>\n<|im_start|>user\n")
  assert tok.stop_ids[0] not in ids[-3:]  # the last (truncated) turn stays open


class Scripted(BaseTextEnv):
  """Answers every turn with the observations in extras["script"]; records close."""
  closed = []

  def __init__(self, env_config=None, extras={}):
    super().__init__()
    self.script = list(extras["script"])

  def step(self, action):
    return {"observations": self.script.pop(0), "reward": 0.5, "done": False,
            "metadata": {"action": action}}

  def close(self):
    Scripted.closed.append(self)


def test_empty_observation_is_the_generation_prompt(tok):
  task = TextTask("x", ({"role": "user", "content": "hi"},), {"script": [[], []]})
  env = skyrl_environment(Scripted, task, tok)
  ids = list(env.reset(task))
  step = env.step(turn(tok, "#### 70"))
  assert tok.decode(step.observation, skip_special_tokens=False) == (
      "\n<|im_start|>assistant\n")
  assert (step.reward, step.done, step.info) == (0.5, False, {"action": "#### 70"})
  ids += list(turn(tok, "#### 70")) + list(step.observation)
  step = env.step(turn(tok, "#### 72", stop=False))  # truncated, then no observation
  assert tok.decode(step.observation, skip_special_tokens=False) == (
      "<|im_end|>\n<|im_start|>assistant\n")
  ids += list(turn(tok, "#### 72", stop=False)) + list(step.observation)
  assert ids == tok.chat([*task.messages, {"role": "assistant", "content": "#### 70"},
                          {"role": "assistant", "content": "#### 72"}])
  env.close()
  assert Scripted.closed[-1] is env.env


def test_bad_observations_name_the_field_and_value(tok):
  task = TextTask("x", ({"role": "user", "content": "hi"},),
                  {"script": [[{"role": "user"}], "text"]})
  env = skyrl_environment(Scripted, task, tok)
  env.reset(task)
  with pytest.raises(EnvironmentError, match=r"environment 'Scripted', step 1 \(turn\): "
                     r"observations\[0\]: a dict with str 'role' and 'content' expected, "
                     r"got \{'role': 'user'\}"):
    env.step(turn(tok, "a"))
  with pytest.raises(EnvironmentError, match=r"step 2 .*observations: a list of messages "
                     r"expected, got 'text'"):
    env.step(turn(tok, "b"))
  with pytest.raises(EnvironmentError, match=r"task.messages\[0\]: .* got 'hi'"):
    SkyrlEnv(Scripted(extras={"script": []}), tok).reset(TextTask("x", ("hi",)))


class Malformed(Scripted):
  """init and step metadata as extras say: the malformed outputs a user's env gives."""

  def __init__(self, env_config=None, extras={}):
    super().__init__(env_config, extras)
    self.init_out, self.metadata = extras["init_out"], extras["metadata"]

  def init(self, prompt):
    return prompt if self.init_out == "prompt" else (prompt, self.init_out)

  def step(self, action):
    return {**super().step(action), "metadata": self.metadata}


def test_malformed_init_and_step_metadata_are_named(tok):
  messages = ({"role": "user", "content": "hi"},)
  bare = TextTask("x", messages, {"script": [], "init_out": "prompt", "metadata": None})
  with pytest.raises(EnvironmentError, match=r"environment 'Malformed', step 0 \(reset\): "
                     r"init: a \(messages, metadata\) tuple expected, got \[\{'role': 'user'"):
    skyrl_environment(Malformed, bare, tok).reset(bare)
  listed = TextTask("x", messages, {"script": [], "init_out": ["a"], "metadata": None})
  with pytest.raises(EnvironmentError, match=r"step 0 .*init metadata: a dict or None "
                     r"expected, got \['a'\]"):
    skyrl_environment(Malformed, listed, tok).reset(listed)
  task = TextTask("x", messages, {"script": [[]], "init_out": {}, "metadata": [("k", 1)]})
  env = skyrl_environment(Malformed, task, tok)
  env.reset(task)
  with pytest.raises(EnvironmentError, match=r"environment 'Malformed', step 1 \(turn\): "
                     r"metadata: a dict or None expected, got \[\('k', 1\)\]"):
    env.step(turn(tok, "a"))


def test_unknown_env_id_and_missing_package(tok, monkeypatch):
  with pytest.raises(ValueError, match=r"skyrl environment 'no_such_env' is not registered; "
                     r"registered: \[.*'gsm8k_multi_turn'"):
    skyrl_environment("no_such_env", TASK, tok)
  monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # as if not installed
  with pytest.raises(ImportError, match=r"skyrl environment 'gsm8k_multi_turn': skyrl-gym "
                     r"is not installed"):
    skyrl_environment("gsm8k_multi_turn", TASK, tok)


# ---- end to end: the agent loop on the JAX engine, a tiny random Qwen2 checkpoint ----

def test_gsm8k_episodes_on_a_random_qwen2(tok, tmp_path):
  """2 groups x 2 episodes of skyrl's GSM8kMultiTurnEnv (registered id) through the
  agent loop on a tiny random Qwen2 checkpoint loaded with models/hf.py. The path is
  what is checked, not learning: turns end where the env says done, rewards are
  skyrl's scores of the sampled texts, masks and log-probs split turns from
  observations, and the trajectory is the chat template's rendering of the talk.

  The random policy samples from a small alphabet (PromptSpec.banned bans the rest of
  the vocabulary): "#", " ", digits and their merges, and both stop tokens. So its turns
  end on <|im_end|>, on <|endoftext|> or at the length limit, and some answer in the
  format ("#### 70": a format reward, or "#### 72": right, done before max_turns)."""
  import jax
  from flax import nnx
  from skyrl_gym.envs.gsm8k import utils as gsm8k

  from hf_helpers import make_checkpoint
  from knittrans_jax.mesh import MeshConfig, make_mesh
  from knittrans_jax.models import hf
  from knittrans_jax.rollout.agent_loop import AgentConfig, AgentLoop, EpisodeGroup
  from knittrans_jax.rollout.engine import EngineSpec, PromptSpec
  from knittrans_jax.rollout.jax_engine import JaxEngine
  from knittrans_jax.rollout.sampler import SamplerConfig

  make_checkpoint("qwen2", str(tmp_path), seed=0, vocab_size=tok.vocab_size, hidden_size=64,
                  intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512)
  one = MeshConfig(axes=(("fsdp", 1),), rules=())  # one device: a tiny model, no sharding
  model, config = hf.load(str(tmp_path), mesh=make_mesh(one, jax.devices()[:1]), rules=())
  graphdef, params = nnx.split(model)
  alphabet = [i for i in range(tok.vocab_size)
              if (text := tok.decode([i])) and set(text) <= set("# 0123456789")]
  assert tok.encode("#### 72")[0] in alphabet  # "####" is one token of the corpus
  allowed = {*alphabet, *tok.stop_ids}
  sampler = SamplerConfig(max_new_tokens=8, temperature=1.0, stop_tokens=tok.stop_ids)
  prompts = PromptSpec(banned=tuple(i for i in range(tok.vocab_size) if i not in allowed))
  engine = JaxEngine(EngineSpec("jax", config, sampler, 0, rows_per_call=4, prompts=prompts),
                     graphdef, params, 0)
  loop = AgentLoop(engine, AgentConfig(max_turns=3, max_tokens=512),
                   vocab_size=tok.vocab_size, max_new_tokens=sampler.max_new_tokens)
  envs = {g: [skyrl_environment("gsm8k_multi_turn", TASK, tok) for _ in range(2)]
          for g in range(2)}
  for g in range(2):
    loop.add(g, "gsm8k", envs[g], TASK, (121 + 2 * g, 122 + 2 * g))
  out = {o.group_id: o for o in loop.run()}
  loop.close()

  end_of_turn = tok.stop_ids[0]  # <|im_end|>, what the template closes a turn with
  assert tok.decode([end_of_turn], skip_special_tokens=False) == "<|im_end|>"
  ground_truth = TASK.extras["reward_spec"]["ground_truth"]
  ends, scores = set(), set()  # what the seeds exercised
  for g in range(2):
    assert isinstance(out[g], EpisodeGroup), out[g]
    for ep, env in zip(out[g].episodes, envs[g]):
      max_turns = env.env.max_turns  # the env's own count (extras["max_turns"])
      assert list(ep.prompt) == tok.chat(list(TASK.messages), add_generation_prompt=True)
      # The texts the env saw: each turn decoded without its stop token.
      texts = [tok.decode(t.tokens[:-1] if t.finish_reason == "stop" else t.tokens)
               for t in ep.turns]
      # Replay them on a fresh skyrl env: its done and observations, and the rewards
      # of skyrl's own GSM8K scoring, with no adapter in between.
      replay = skyrl_gym.make("gsm8k_multi_turn", extras=dict(TASK.extras))
      conversation, _ = replay.init([dict(m) for m in TASK.messages])
      rewards, done = [], False
      for k, text in enumerate(texts):
        assert not done, f"turn {k} after the env said done"
        step = replay.step(text)
        done = step["done"]
        rewards.append(gsm8k.compute_score(text, ground_truth, method="strict",
                                           format_score=0.2 / max_turns, score=1.0))
        assert step["reward"] == rewards[-1]
        conversation = [*conversation, {"role": "assistant", "content": text},
                        *step["observations"]]
      # The episode ends where the env says done: a right answer or its max_turns.
      want_turns = next((k + 1 for k, r in enumerate(rewards) if r == 1.0), max_turns)
      assert done and len(ep.turns) == want_turns and ep.end == "done"
      assert ep.reward == pytest.approx(sum(rewards))
      assert env.messages == conversation  # the adapter's conversation is skyrl's
      scores |= set(rewards)
      # Masks and log-probs: 1 exactly on sampled tokens, 0 (and log-prob 0) on the
      # observations; an observation follows every turn but the last.
      tokens, logprobs, mask = ep.response()
      want_mask = []
      for j, t in enumerate(ep.turns):
        assert t.versions == (0, 0) and set(map(int, t.tokens)) <= allowed
        assert (t.finish_reason == "stop") == (int(t.tokens[-1]) in tok.stop_ids)
        assert (t.observation.size > 0) == (j < len(ep.turns) - 1)
        ends.add(int(t.tokens[-1]) if t.finish_reason == "stop" else "length")
        want_mask += [True] * t.tokens.size + [False] * t.observation.size
      np.testing.assert_array_equal(mask, want_mask)
      assert (logprobs[~mask] == 0).all() and (logprobs[mask] < 0).all()
      # The trajectory is the template's rendering of the conversation, up to the last
      # turn's end of turn. A turn that did not end on <|im_end|> (cut by the length
      # limit, or ended by <|endoftext|>) has the template's whole end of turn in its
      # observation (the adapter's doc); the last one's is then not in the episode.
      closed = int(ep.turns[-1].tokens[-1]) == end_of_turn
      rendered = tok.render_chat(conversation, add_generation_prompt=False)
      want = rendered.removesuffix("\n" if closed else "<|im_end|>\n")
      # As text: the sampled ids decode to it where every turn ended on <|im_end|> or
      # at the limit (an <|endoftext|> stays in the ids, not in the conversation).
      if all(t.finish_reason == "length" or t.tokens[-1] == end_of_turn for t in ep.turns):
        assert tok.decode(np.concatenate([ep.prompt, tokens]), skip_special_tokens=False) == want
      # As ids: with each turn replaced by the tokenization of its text (and its
      # <|im_end|>, if it ended on one), the trajectory is the tokenized rendering.
      canonical = list(ep.prompt)
      for t, text in zip(ep.turns, texts):
        canonical += tok.encode(text) + ([end_of_turn] if t.tokens[-1] == end_of_turn else [])
        canonical += list(t.observation)
      assert canonical == tok.encode(want)
  # The seeds exercised every kind of turn end, and both a format reward and none.
  assert ends == {*tok.stop_ids, "length"}, ends
  assert len(scores) > 1, scores
