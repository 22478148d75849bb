"""A checkpoint's tokenizer and chat template, without transformers.

    tok = Tokenizer.from_dir("/ckpt/Qwen2.5-0.5B-Instruct")
    ids = tok.chat([{"role": "user", "content": "What is 3 + 4?"}])
    text = tok.decode(response_ids)

Reads `tokenizer.json` with the `tokenizers` package (the Rust tokenizer that
transformers' fast tokenizers wrap) and `tokenizer_config.json` (special tokens,
`chat_template`) or `chat_template.jinja`; the template is rendered with jinja2 in a
sandbox, with the variables and helpers transformers gives it (`raise_exception`,
`strftime_now`, `tools`/`documents` as None, the `{% generation %}` tag). Stop tokens are the
EOS token plus `generation_config.json`'s eos_token_id(s).
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers


class TokenizerError(ValueError):
  pass


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return value.get("content")
  return value


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


class Tokenizer:

  def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict[str, Any],
               generation: dict[str, Any] | None = None, chat_template: str | None = None,
               source: str = "<memory>"):
    self._tok, self.config, self.source = tokenizer, config, source
    self.bos_token = _token_text(config.get("bos_token"))
    self.eos_token = _token_text(config.get("eos_token"))
    self.pad_token = _token_text(config.get("pad_token"))
    self.chat_template = chat_template or config.get("chat_template")
    if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
      named = {t["name"]: t["template"] for t in self.chat_template}
      self.chat_template = named.get("default")
    stops = []
    if self.eos_token is not None:
      stops.append(self._id(self.eos_token, "eos_token"))
    eos = (generation or {}).get("eos_token_id")
    for i in ([eos] if isinstance(eos, int) else eos or []):
      if i not in stops:
        stops.append(int(i))
    self.stop_ids = tuple(stops)
    self.pad_id = (self._id(self.pad_token, "pad_token") if self.pad_token is not None
                   else (self.stop_ids[0] if self.stop_ids else 0))

  @classmethod
  def from_dir(cls, path: str) -> "Tokenizer":
    fn = os.path.join(path, "tokenizer.json")
    if not os.path.exists(fn):
      raise TokenizerError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    template = None
    jinja_fn = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_fn):
      with open(jinja_fn, encoding="utf-8") as f:
        template = f.read()
    return cls(tokenizers.Tokenizer.from_file(fn),
               _read_json(os.path.join(path, "tokenizer_config.json")),
               _read_json(os.path.join(path, "generation_config.json")), template, path)

  def _id(self, token: str, what: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise TokenizerError(f"{self.source}: {what} {token!r} is not in the vocabulary")
    return i

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                  **variables) -> str:
    """The chat template applied to `messages`, as text."""
    if not self.chat_template:
      raise TokenizerError(f"{self.source}: the tokenizer has no chat_template")
    context = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                   bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                   tools=None, documents=None)
    context.update(variables)
    return _compile(self.chat_template).render(**context)

  def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
           **variables) -> list[int]:
    """Token ids of the rendered chat; the template writes any special tokens itself."""
    return self.encode(self.render_chat(messages, add_generation_prompt, **variables))


def _raise(message):
  raise TokenizerError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with
  it for masks); rendering just emits the body."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.Scope(body, lineno=lineno)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
  """As transformers compiles chat templates: a sandbox, trimmed blocks, loop controls,
  `raise_exception` and a `tojson` that keeps non-ASCII text."""
  if source not in _TEMPLATES:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    _TEMPLATES[source] = env.from_string(source)
  return _TEMPLATES[source]
