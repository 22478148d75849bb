"""Hugging Face checkpoints in and out: Qwen2/2.5, Qwen3 and Llama 3 decoders.

    model, config = hf.load("/ckpt/Qwen2.5-0.5B", dtype="bfloat16", mesh=mesh, rules=rules)
    hf.save(model, config, "/out/step_100")

This module maps the decoder's parameters onto the checkpoint's tensor names and
config.json; reading and writing are models/checkpoint_io.py's (each device reads
only its own slice of the memory-mapped file; no torch at run time).
"""
from __future__ import annotations

import os
import re
from typing import Any

from flax import nnx

from knittrans_jax.models import scan as layer_scan
from knittrans_jax.models.checkpoint_io import (CheckpointDir, CheckpointError,
                                                Source, host_array, load_params, read_config,
                                                transposed, write_checkpoint)
from knittrans_jax.models.decoder import DecoderConfig, DecoderLM

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "llama": "LlamaForCausalLM"}
# Tensors some exporters write that are derived, not parameters.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# -- config.json <-> DecoderConfig ----------------------------------------------
def config_from_hf(hf: dict[str, Any], **overrides) -> DecoderConfig:
  """A DecoderConfig from a config.json dict; `overrides` (dtype, remat, ...) win."""
  mt = hf.get("model_type")
  if mt not in ARCHITECTURES:
    raise CheckpointError(f"config.json: unknown architecture model_type={mt!r} "
                          f"(architectures={hf.get('architectures')}); supported: "
                          f"{sorted(ARCHITECTURES)}")
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"config.json: hidden_act={hf['hidden_act']!r}; only 'silu' is supported")
  if mt == "qwen2" and hf.get("use_sliding_window"):
    raise CheckpointError("config.json: use_sliding_window=true is not supported")
  if mt in ("qwen3", "llama") and hf.get("attention_bias"):
    raise CheckpointError(f"config.json: attention_bias=true ({mt}: bias on o_proj too) "
                          "is not supported")
  if hf.get("mlp_bias"):
    raise CheckpointError("config.json: mlp_bias=true is not supported")
  # transformers 4 writes rope_theta + rope_scaling; 5 writes rope_parameters.
  rp = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or rp)
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type not in ("default", "llama3"):
    raise CheckpointError(f"config.json: rope_type={rope_type!r} is not supported "
                          "(default, llama3)")
  heads = hf["num_attention_heads"]
  kw = dict(
      vocab_size=hf["vocab_size"], width=hf["hidden_size"], depth=hf["num_hidden_layers"],
      heads=heads, mlp_width=hf["intermediate_size"],
      kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      rope_theta=float(hf.get("rope_theta", rp.get("rope_theta", 10000.0))),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),  # transformers' default
      qkv_bias=mt == "qwen2", qk_norm=mt == "qwen3",
      max_positions=int(hf.get("max_position_embeddings", 4096)), family=mt)
  if rope_type == "llama3":
    kw.update(rope_type="llama3", rope_factor=float(scaling["factor"]),
              rope_low_freq_factor=float(scaling["low_freq_factor"]),
              rope_high_freq_factor=float(scaling["high_freq_factor"]),
              rope_original_max_positions=int(scaling["original_max_position_embeddings"]))
  kw.update(overrides)
  return DecoderConfig(**kw)


def hf_family(config: DecoderConfig) -> str:
  """The format `save` writes: the config's family, or for 'toy' the one it fits."""
  if config.family != "toy":
    return config.family
  if config.qk_norm and not config.qkv_bias:
    return "qwen3"
  if config.qkv_bias and not config.qk_norm:
    return "qwen2"
  if not (config.qk_norm or config.qkv_bias):
    return "llama"
  raise CheckpointError("DecoderConfig with both qkv_bias and qk_norm has no Hugging Face format")


def config_to_hf(config: DecoderConfig, dtype: str, **extra) -> dict[str, Any]:
  if config.mrope_section:  # Qwen2-VL's language model: its format is the whole VLM's
    raise CheckpointError(f"DecoderConfig with mrope_section {config.mrope_section} (a Qwen2-VL "
                          "language model) cannot be written as a text-only checkpoint")
  fam = hf_family(config)
  if fam == "qwen2" and (not config.qkv_bias or config.qk_norm):
    raise CheckpointError("family 'qwen2' needs qkv_bias=True and qk_norm=False")
  if fam == "qwen3" and (config.qkv_bias or not config.qk_norm):
    raise CheckpointError("family 'qwen3' needs qk_norm=True and qkv_bias=False")
  if fam == "llama" and (config.qkv_bias or config.qk_norm):
    raise CheckpointError("family 'llama' needs qkv_bias=False and qk_norm=False")
  out = {
      "architectures": [ARCHITECTURES[fam]], "model_type": fam, "vocab_size": config.vocab_size,
      "hidden_size": config.width, "intermediate_size": config.mlp_width,
      "num_hidden_layers": config.depth, "num_attention_heads": config.heads,
      "num_key_value_heads": config.num_kv_heads, "head_dim": config.dim_per_head,
      "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
      "max_position_embeddings": config.max_positions,
      "tie_word_embeddings": config.tie_embeddings, "torch_dtype": dtype,
      "attention_bias": False, "use_cache": True,
  }
  if fam == "qwen2":
    out.update(use_sliding_window=False, sliding_window=None)
  if fam == "llama":
    out["mlp_bias"] = False
  if config.rope_type == "llama3":
    out["rope_scaling"] = {
        "rope_type": "llama3", "factor": config.rope_factor,
        "low_freq_factor": config.rope_low_freq_factor,
        "high_freq_factor": config.rope_high_freq_factor,
        "original_max_position_embeddings": config.rope_original_max_positions}
  out.update(extra)
  return out


# -- parameter names -------------------------------------------------------------
_LAYER = {("norm1", "scale"): ("input_layernorm.weight", False),
          ("norm2", "scale"): ("post_attention_layernorm.weight", False),
          ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", False),
          ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", False)}
for _p in "qkvo":
  _LAYER[("attn", _p, "kernel")] = (f"self_attn.{_p}_proj.weight", True)
  _LAYER[("attn", _p, "bias")] = (f"self_attn.{_p}_proj.bias", False)
for _p in ("gate", "up", "down"):
  _LAYER[("mlp", _p, "kernel")] = (f"mlp.{_p}_proj.weight", True)
_TOP = {("embed", "embedding"): ("model.embed_tokens.weight", False),
        ("norm", "scale"): ("model.norm.weight", False),
        ("head", "kernel"): ("lm_head.weight", True)}


def hf_name(path: tuple) -> tuple[str, bool]:
  """Our parameter path -> (Hugging Face tensor name, stored transposed?)."""
  path = tuple(p.key if hasattr(p, "key") else getattr(p, "idx", p) for p in path)
  if path[0] == "blocks":
    name, transposed = _LAYER[tuple(path[2:])]
    return f"model.layers.{int(path[1])}.{name}", transposed
  return _TOP[tuple(path)]


# -- loading -----------------------------------------------------------------------
def abstract_model(config: DecoderConfig):
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: DecoderLM(config, nnx.Rngs(0)))


def load(path: str, dtype: str = "float32", *, mesh=None, rules=None,
         **overrides) -> tuple[DecoderLM, DecoderConfig]:
  """Loads a Hugging Face decoder directory onto the mesh.

  `dtype` sets both the parameters' and the activations' dtype (pass `param_dtype`
  in `overrides` to keep parameters wider). `mesh`/`rules` default to the gin
  MeshConfig over all devices. Raises CheckpointError naming the tensor and both
  shapes on any mismatch, and any missing or unexpected tensor."""
  overrides = {"dtype": dtype, "param_dtype": dtype, **overrides}
  config = config_from_hf(read_config(path), **overrides)
  return load_weights(path, config, mesh=mesh, rules=rules), config


def load_weights(path: str, config: DecoderConfig, *, mesh=None, rules=None,
                 prefix: str = "model.", owns=None) -> DecoderLM:
  """A DecoderLM of `config` with the parameters of the checkpoint directory `path`
  (see `load`). A VLM's language model: `prefix` replaces the 'model.' of the tensor
  names (e.g. 'model.language_model.'), and `owns(name)` says which of the
  directory's tensors are the decoder's (the others, a vision tower's, are left
  alone); by default all are."""
  tensors = CheckpointDir(path)
  graphdef, abs_params, rest = nnx.split(abstract_model(config), nnx.Param, ...)

  def source(p, shape):
    name, tr = hf_name(p)
    if name.startswith("model."):
      name = prefix + name.removeprefix("model.")
    return transposed(name, shape) if tr else Source(name, shape)

  present = {n for n in tensors.names if not _IGNORED.match(n) and (owns is None or owns(n))}
  if config.tie_embeddings:  # some exporters write the tied head too; it is the embedding
    present.discard("lm_head.weight")
  params = load_params(path, tensors, abs_params, source, present, mesh=mesh, rules=rules,
                       dtype=config.param_dtype, what=f"the {config.family} architecture",
                       desc=f"loading {os.path.basename(path.rstrip('/'))}")
  return nnx.merge(graphdef, params, rest)


# -- saving ------------------------------------------------------------------------
def save(model: DecoderLM, config: DecoderConfig, path: str, dtype: str | None = None,
         max_shard_bytes: int = 4 << 30, extra_config: dict | None = None) -> list[str]:
  """Writes `model` as a Hugging Face directory (config.json, model*.safetensors and an
  index when sharded) that transformers loads. One tensor at a time is gathered to
  the host; only process 0 writes. Returns the files written."""
  dtype = dtype or config.param_dtype
  return write_checkpoint(path, decoder_tensors(nnx.state(model, nnx.Param)),
                          config_to_hf(config, dtype, **(extra_config or {})), dtype,
                          max_shard_bytes)


def decoder_tensors(params) -> dict[str, tuple[Any, tuple[int, ...]]]:
  """{Hugging Face name: (fetch() -> the host tensor as stored, its stored shape)} of a
  DecoderLM's parameters (an nnx.State)."""
  out = {}
  for p, shape, get in layer_scan.layer_entries(params):  # a scanned stack layer by layer
    name, tr = hf_name(p)
    out[name] = ((lambda get=get, tr=tr: host_array(get()).T if tr else host_array(get())),
                 shape[::-1] if tr else shape)
  return out
