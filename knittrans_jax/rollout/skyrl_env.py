"""skyrl-gym text environments at the token level: an adapter over `BaseTextEnv`.

    task = TextTask("gsm8k", ({"role": "user", "content": "..."},),
                    {"reward_spec": {"ground_truth": "72"}, "max_turns": 3})
    env = skyrl_environment("gsm8k_multi_turn", task, tokenizer)
    prompt = env.reset(task)        # the chat template with the generation prompt
    step = env.step(turn_ids)       # the sampled turn, stop token included or not

A skyrl-gym env speaks OpenAI-style messages and text; the agent loop speaks token
ids. The adapter keeps the conversation as messages and turns each step's observation
messages into exactly the ids the chat template puts between the end of the model's
turn and the start of the next generation, so that

    prompt + turn_1 + obs_1 + ... + turn_k + obs_k
        == tokenizer.chat(whole conversation, add_generation_prompt=True)

whenever each turn's ids are the tokenization of its text (scripted turns; a sampled
turn keeps its own ids, which is what the policy saw). skyrl_gym is imported only by
`skyrl_environment`, so this module imports without it (requirements-test.txt).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from knittrans_jax.data.tokenizer import Tokenizer
from knittrans_jax.rollout.environment import Environment, EnvironmentError, EnvStep, checked_ids

INSTALL = "pip install skyrl-gym==0.4.0"


@dataclasses.dataclass(frozen=True)
class TextTask:
  """One episode of a text environment. `source`: the task's source (the quota it counts
  toward); `messages`: the prompt, OpenAI-style {"role", "content"} dicts, given to the
  env's `init`; `extras`: the env's constructor `extras` (e.g. {"reward_spec":
  {"ground_truth": "72"}, "max_turns": 3}), used by `skyrl_environment`, not by reset."""
  source: str
  messages: tuple[Mapping[str, str], ...]
  extras: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def checked_messages(env: str, step: int, field: str, messages) -> list[dict[str, str]]:
  """`messages` as a list of {"role": str, "content": str}, or an EnvironmentError naming
  the offending entry and its value."""
  if not isinstance(messages, (list, tuple)):
    raise EnvironmentError(env, step, f"{field}: a list of messages expected, got "
                           f"{messages!r}")
  out = []
  for i, m in enumerate(messages):
    if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      raise EnvironmentError(env, step, f"{field}[{i}]: a dict with str 'role' and "
                             f"'content' expected, got {m!r}")
    out.append(dict(m))
  return out


def checked_metadata(env: str, step: int, field: str, value) -> dict[str, Any]:
  """An env's metadata as a dict (None: empty), or an EnvironmentError naming it."""
  if value is None:
    return {}
  if not isinstance(value, Mapping):
    raise EnvironmentError(env, step, f"{field}: a dict or None expected, got {value!r}"[:400])
  return dict(value)


class SkyrlEnv(Environment):
  """One skyrl-gym `BaseTextEnv` instance (anything with `init`, `step`, `close`) and the
  policy's tokenizer. `template_vars` go to the chat template (e.g. enable_thinking)."""

  def __init__(self, env, tokenizer: Tokenizer, name: str | None = None,
               template_vars: Mapping[str, Any] | None = None):
    self.env, self.tok = env, tokenizer
    self.name = name or type(env).__name__
    self.template_vars = dict(template_vars or {})
    self.init_metadata: dict[str, Any] = {}
    self._messages: list[dict[str, str]] = []  # the conversation so far
    self._text = ""  # its rendering with the generation prompt: the context, as text
    self._turn = 0

  @property
  def messages(self) -> list[dict[str, str]]:
    """The conversation so far: the init prompt, then each turn and its observations."""
    return [dict(m) for m in self._messages]

  def _render(self, messages, add_generation_prompt: bool) -> str:
    return self.tok.render_chat(messages, add_generation_prompt, **self.template_vars)

  def reset(self, task: TextTask) -> np.ndarray:
    prompt = checked_messages(self.name, 0, "task.messages", task.messages)
    out = self.env.init(prompt)
    # skyrl's contract: a (messages, metadata) tuple; a bare message list would unpack
    # into two messages, or fail as an unrelated Python error.
    if not (isinstance(out, tuple) and len(out) == 2):
      raise EnvironmentError(self.name, 0, "init: a (messages, metadata) tuple expected, got "
                             f"{out!r}"[:400])
    messages, metadata = out
    self._messages = checked_messages(self.name, 0, "init messages", messages)
    self.init_metadata = checked_metadata(self.name, 0, "init metadata", metadata)
    self._turn = 0
    self._text = self._render(self._messages, True)
    return np.asarray(self.tok.encode(self._text), np.int32)

  def step(self, response: np.ndarray) -> EnvStep:
    self._turn += 1
    ids = checked_ids(self.name, self._turn, "response", response, self.tok.vocab_size)
    stopped = ids.size > 0 and int(ids[-1]) in self.tok.stop_ids
    # The env sees the text without the stop token (and without any other special token,
    # as a text-generating server would return it).
    text = self.tok.decode(ids[:-1] if stopped else ids)
    out = self.env.step(text)
    if not isinstance(out, Mapping) or not {"observations", "reward", "done"} <= set(out):
      raise EnvironmentError(self.name, self._turn, "step: a dict with observations, reward "
                             f"and done expected, got {out!r}")
    observations = checked_messages(self.name, self._turn, "observations",
                                     out["observations"])
    info = checked_metadata(self.name, self._turn, "metadata", out.get("metadata"))
    if out.get("postprocessed_action") is not None:
      # skyrl's own generator re-tokenizes the edited action; here the sampled ids
      # stay in the context (they are what the policy generated), so it is only noted.
      info["postprocessed_action"] = out["postprocessed_action"]
    done = out["done"]
    if isinstance(done, (bool, np.bool_)) and done:
      obs = np.zeros(0, np.int32)  # the loop appends nothing after the last turn
      # The conversation still records the last turn (and any closing observations).
      self._messages += [{"role": "assistant", "content": text}, *observations]
    else:
      obs = self._observation(text, int(ids[-1]) if stopped else None, observations)
    # Reward and done as the env gave them: the loop's checked_step judges them.
    return EnvStep(obs, out["reward"], done, info)

  def _observation(self, text: str, stop: int | None, observations) -> np.ndarray:
    """The ids from the end of the sampled turn to the next generation prompt, cut from
    renderings of the conversation: `closed` (up to the assistant's turn, its end of
    turn included) and `nxt` (then the observations and the generation prompt)."""
    assistant = [*self._messages, {"role": "assistant", "content": text}]
    closed = self._render(assistant, False)
    if not closed.startswith(self._text + text):
      raise EnvironmentError(self.name, self._turn, "the chat template does not render the "
                             "assistant's turn as the context plus its text (it edits the "
                             f"text or earlier turns); after the turn it renders "
                             f"{closed[len(self._text):][:200]!r}")
    # What the template writes after the assistant's text, e.g. Qwen's "<|im_end|>\n".
    # A turn that ended on its stop token already holds the end-of-turn token; a turn
    # cut by the length limit (or ended by another stop token) gets the whole tail.
    tail = closed[len(self._text) + len(text):]
    if stop is not None:
      stop_text = self.tok.decode([stop], skip_special_tokens=False)
      if tail.startswith(stop_text):
        tail = tail[len(stop_text):]
    messages = assistant + observations
    nxt = self._render(messages, True)
    if not nxt.startswith(closed):
      raise EnvironmentError(self.name, self._turn, "the chat template renders earlier turns "
                             "differently once the observations follow; observations "
                             f"{observations!r}")
    # Encoding the new text on its own gives the ids encoding the whole would: the
    # text before it ends in the turn's end-of-turn special token (or the tail starts
    # with one), and the tokenizer splits text at special tokens before merging.
    self._messages, self._text = messages, nxt
    return np.asarray(self.tok.encode(tail + nxt[len(closed):]), np.int32)

  def close(self) -> None:
    self.env.close()  # BaseTextEnv.close: a no-op unless the env holds something


def skyrl_environment(env: str | type, task: TextTask, tokenizer: Tokenizer,
                      env_config: Mapping[str, Any] | None = None,
                      template_vars: Mapping[str, Any] | None = None) -> SkyrlEnv:
  """A SkyrlEnv for one episode of `task`: `env` is a registered skyrl-gym id (e.g.
  "gsm8k_multi_turn", or one a researcher's package registered with
  `skyrl_gym.register`) or a BaseTextEnv class; it is built as skyrl builds its envs,
  `cls(env_config=..., extras=task.extras)`. `env_config` becomes an OmegaConf config,
  which skyrl's envs read by attribute."""
  label = env if isinstance(env, str) else getattr(env, "__name__", repr(env))
  try:
    import skyrl_gym
    from omegaconf import OmegaConf
  except ImportError as e:
    raise ImportError(f"skyrl environment {label!r}: skyrl-gym is not installed "
                      f"({INSTALL})") from e
  config = OmegaConf.create(dict(env_config or {}))
  extras = dict(task.extras)
  if isinstance(env, str):
    if env not in skyrl_gym.registry:
      raise ValueError(f"skyrl environment {env!r} is not registered; registered: "
                       f"{sorted(skyrl_gym.registry)} (register yours with "
                       "skyrl_gym.register, or pass its class)")
    instance = skyrl_gym.make(env, env_config=config, extras=extras)
  elif isinstance(env, type):
    instance = env(env_config=config, extras=extras)
  else:
    raise TypeError(f"skyrl environment {env!r}: a registered id or a BaseTextEnv class "
                    f"expected, got {type(env).__name__}")
  return SkyrlEnv(instance, tokenizer, label, template_vars)
