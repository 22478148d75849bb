"""Tiny random Hugging Face checkpoints of each supported family, made with
transformers on PyTorch CPU (test-only dependencies, requirements-test.txt).

torch and transformers are imported by the helpers that use them (and by FAMILIES and
QWEN_VL, built on first use): importing this module for make_tokenizer alone stays fast."""
from __future__ import annotations

import numpy as np

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6)


def _families() -> dict:
  import transformers
  return {
    # Qwen2.5: GQA, q/k/v bias, tied embeddings.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    # Qwen3: per-head q/k RMSNorm, explicit head_dim != hidden / heads, untied.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False)),
    # Llama 3.2: llama3 RoPE scaling, tied. With head_dim 8 the wavelengths are 6.3,
    # 167, 4443 and 118k positions; an original length of 600 puts them in all three
    # bands (kept, smoothed, divided by the factor).
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(rope_theta=500000.0, tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 600})),
  }


def make_checkpoint(family: str, path: str, seed: int = 0, dtype=None, **overrides):
  """Saves a random model of `family` to `path` (`dtype`: a torch dtype, float32 by
  default); returns the torch model (eval mode)."""
  import torch
  cfg_cls, model_cls, extra = _lazy("FAMILIES")[family]
  torch.manual_seed(seed)
  model = model_cls(cfg_cls(**{**COMMON, **extra, **overrides})).eval()
  with torch.no_grad():  # random norms and biases too, so a mapping mistake shows
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.1 * torch.randn_like(p))
  model = model.to(torch.float32 if dtype is None else dtype)
  model.save_pretrained(path)
  return model


# Tiny Qwen2-VL / Qwen2.5-VL checkpoints (tests/test_qwen_vl_model.py,
# tests/test_qwen_vl_encode_once.py). Token ids of the image-pad, video-pad and
# vision start / end tokens:
IMAGE, VIDEO, START, END = 90, 91, 92, 93
# Head dim 16: 8 rotary frequencies, split 2 / 3 / 3 over (t, h, w) like the released
# (16, 24, 24); theta 1e4 so that small positions turn the pairs visibly.
QWEN_VL_TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                    pad_token_id=0, rope_parameters={"rope_type": "default",
                                                     "mrope_section": [2, 3, 3],
                                                     "rope_theta": 10000.0})
QWEN_VL_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                   vision_end_token_id=END)
def _qwen_vl() -> dict:
  import transformers
  return {  # family -> (config class, model class, vision_config, tied embeddings)
    # Tied embeddings, as Qwen2-VL-2B.
    "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration,
                 dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2), True),
    # Windows of 2 x 2 merged tokens, layer 1 of 3 full; untied, as the 7B models.
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                   dict(depth=3, hidden_size=32, intermediate_size=40, out_hidden_size=64,
                        num_heads=4, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                        window_size=16, fullatt_block_indexes=[1]), False),
  }


def __getattr__(name: str):
  """FAMILIES and QWEN_VL, built (transformers imported) on first use."""
  build = {"FAMILIES": _families, "QWEN_VL": _qwen_vl}.get(name)
  if build is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value = build()
  return value


def _lazy(name: str):
  """FAMILIES or QWEN_VL from inside the module (where __getattr__ is not consulted)."""
  return globals().get(name) or __getattr__(name)


def make_qwen_vl_checkpoint(family: str, path: str, seed: int = 0, text: dict | None = None,
                            vision: dict | None = None):
  """Saves a random tiny Qwen-VL model of `family` (QWEN_VL; `text` and `vision`
  override its text_config and vision_config) to `path`; returns the torch model (eval
  mode)."""
  import torch
  cfg_cls, model_cls, vision_config, tied = _lazy("QWEN_VL")[family]
  torch.manual_seed(seed)
  model = model_cls(cfg_cls(text_config={**QWEN_VL_TEXT, **(text or {})},
                            vision_config={**vision_config, **(vision or {})},
                            tie_word_embeddings=tied, **QWEN_VL_IDS)).eval()
  randomize_vl_(model.named_parameters())
  model.save_pretrained(path)
  return model


def randomize_vl_(named_parameters) -> None:
  """In place: weights of std 1 / sqrt(fan in) (not transformers' 0.02), so attention
  logits are O(1) and masks and positions change the output; random norms and
  biases, so a mapping mistake shows."""
  import torch
  with torch.no_grad():
    for name, p in named_parameters:
      if p.ndim > 1:
        p.normal_(0, p[0].numel() ** -0.5)
      elif ("norm" in name or "ln_q" in name) and name.endswith(".weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.1 * torch.randn_like(p))


def torch_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """Logits with the positions our decoder uses: real tokens counted from 0."""
  import torch
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                attention_mask=torch.from_numpy(mask.astype(np.int64)),
                position_ids=torch.from_numpy(positions.astype(np.int64)))
  return out.logits.float().numpy()


def padded_batch(seed: int = 0, vocab: int = 96):
  """Two rows left-padded and two right-padded, of different lengths."""
  rng = np.random.default_rng(seed)
  T = 12
  tokens = rng.integers(2, vocab, size=(4, T)).astype(np.int32)
  mask = np.zeros((4, T), np.int32)
  mask[0, 3:] = 1   # left padding
  mask[1, 7:] = 1
  mask[2, :9] = 1   # right padding
  mask[3, :T] = 1
  tokens = np.where(mask.astype(bool), tokens, 0)
  return tokens, mask


QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(path: str, corpus: list[str], vocab_size: int = 320,
                   added: tuple[str, ...] = ()) -> None:
  """A byte-level BPE tokenizer trained on `corpus`, saved as a Qwen-style fast
  tokenizer directory (tokenizer.json, tokenizer_config.json with a chat template,
  generation_config.json with two stop ids)."""
  import json
  import os

  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(corpus, trainer)
  tok.add_tokens(list(added))  # whole strings as single (non-special) tokens
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "bos_token": None,
               "chat_template": QWEN_TEMPLATE}, f)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [tok.token_to_id("<|im_end|>"),
                                tok.token_to_id("<|endoftext|>")]}, f)
