"""The checkpoint tokenizer and chat template, checked against transformers."""
import json
import os

import pytest
import transformers

from hf_helpers import make_tokenizer
from knittrans_jax.data.prompts import load_prompts
from knittrans_jax.data.tokenizer import Tokenizer, TokenizerError

MATH = os.path.join(os.path.dirname(__file__), "..", "knittrans_jax", "data",
                    "arith_word_problems.jsonl")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tok"))
  prompts = load_prompts(MATH)
  make_tokenizer(path, [p.prompt for p in prompts] + [f"\\boxed{{{p.answer}}}" for p in prompts])
  return path


def test_encode_decode_round_trip(tok_dir):
  tok = Tokenizer.from_dir(tok_dir)
  for text in ["Ana has 12 apples and buys 17 more.", "so the answer is \\boxed{29}.\n",
               "ünïcödé and spaces   too"]:
    assert tok.decode(tok.encode(text)) == text
  theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
  text = "Ana has 12 apples and buys 17 more."
  assert tok.encode(text) == theirs.encode(text, add_special_tokens=False)


def test_chat_template_matches_transformers(tok_dir):
  tok = Tokenizer.from_dir(tok_dir)
  theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
  for messages in ([{"role": "user", "content": "What is 3 + 4?"}],
                   [{"role": "system", "content": "Answer in \\boxed{}."},
                    {"role": "user", "content": "12 * 7?"}]):
    for gen in (True, False):
      want = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
      assert tok.render_chat(messages, gen) == want
      ids = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
      ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
      assert tok.chat(messages, gen) == list(ids)
  text = tok.render_chat([{"role": "user", "content": "hi"}])
  assert text.endswith("<|im_start|>assistant\n") and "You are a helpful assistant." in text


def test_stop_tokens_come_from_the_checkpoint(tok_dir):
  tok = Tokenizer.from_dir(tok_dir)
  assert tok.stop_ids == (tok.encode("<|im_end|>")[0], tok.encode("<|endoftext|>")[0])
  assert tok.pad_id == tok.encode("<|endoftext|>")[0]
  assert tok.decode([*tok.encode("7"), tok.stop_ids[0]]) == "7"


def test_bad_tokenizer_directories(tmp_path, tok_dir):
  with pytest.raises(TokenizerError, match="no tokenizer.json"):
    Tokenizer.from_dir(str(tmp_path))
  cfg = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "tokenizer.json").write_text(open(os.path.join(tok_dir, "tokenizer.json")).read())
  (bad / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|nope|>"}))
  with pytest.raises(TokenizerError, match=r"eos_token '<\|nope\|>' is not in the vocabulary"):
    Tokenizer.from_dir(str(bad))
  (bad / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  with pytest.raises(TokenizerError, match="no chat_template"):
    Tokenizer.from_dir(str(bad)).chat([{"role": "user", "content": "x"}])


LLAMA_LIKE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}"
    "{%- set date_string = '26 Jul 2024' %}{%- endif %}{%- endif %}"
    "{{- '<|im_start|>system\nToday Date: ' + date_string + '<|im_end|>\n' }}"
    "{%- if tools is not none %}{{- 'TOOLS:' + tools|length|string }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] }}"
    "{% endgeneration %}{%- else %}{{- message['content'] }}{%- endif %}"
    "{{- '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def test_llama_style_template_variables_match_transformers(tok_dir, tmp_path):
  """bos_token, date_string / strftime_now, tools left None, the generation tag."""
  import shutil
  d = tmp_path / "llama_like"
  shutil.copytree(tok_dir, d)
  cfg = json.load(open(d / "tokenizer_config.json"))
  cfg.update(chat_template=LLAMA_LIKE, bos_token="<|endoftext|>")
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  ours, theirs = Tokenizer.from_dir(str(d)), transformers.AutoTokenizer.from_pretrained(str(d))
  messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
              {"role": "user", "content": "2+2?"}]
  for kw in ({}, {"date_string": "01 Jan 2025"}):
    want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    assert ours.render_chat(messages, True, **kw) == want
  assert "TOOLS" not in want and "01 Jan 2025" in want
