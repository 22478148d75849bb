"""Qwen2-VL and Qwen2.5-VL: the vision tower (models/qwen_vision.py; its Hugging Face
names models/qwen_vision_hf.py) and the decoder with M-RoPE (models/decoder.py),
loaded from a Hugging Face checkpoint directory.

    model, config = qwen_vl.load("/ckpt/Qwen2.5-VL-7B-Instruct", dtype="bfloat16")
    positions, rope_delta = qwen_vl.mrope_positions(input_ids, image_grid_thw, config, mask)
    logits = model(input_ids, mask, pixel_values, image_grid_thw, positions=positions)

A prompt holds one run of image-pad tokens (`image_token_id`, between
<|vision_start|> and <|vision_end|>) per image, as many as the image has merged
patches; the tower's merged embeddings replace those rows, image by image in
row-major order over the batch (transformers' masked_scatter). Positions are
(temporal, height, width) triples: an image's tokens sit on its merged grid from
the position where the image starts, and the text after it continues from that
start + max(h, w) / merge (transformers' get_rope_index). They depend on the token
ids and image_grid_thw, which are host data, so `mrope_positions` is numpy and
under jit the positions come in as an argument.

Decoding continues text positions: a new token's position is the row's count of
real tokens so far plus the row's rope delta (max prompt position + 1 - prompt
length), which the cache returned by `prefill` carries, so `decode_step` keeps the
decoder's signature. Videos are not supported.

Training with each unique image through the tower once per mini-batch (the n
responses of a prompt share its image): multimodal/qwen_images.py.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knittrans_jax.mesh import mesh_or_default
from knittrans_jax.models import hf
from knittrans_jax.models import qwen_vision as qv
from knittrans_jax.models import qwen_vision_hf as qv_hf
from knittrans_jax.models.decoder import DecoderConfig, DecoderLM
from knittrans_jax.models.checkpoint_io import (CheckpointDir, CheckpointError, read_config,
                                                write_checkpoint)


@dataclasses.dataclass(frozen=True)
class QwenVLConfig:
  """The language model (a Qwen2 decoder with `mrope_section`), the vision tower, and
  the id of the image-pad token the tower's outputs replace."""
  text: DecoderConfig
  vision: qv.QwenVisionConfig
  image_token_id: int = 151655

  def __post_init__(self):
    if not self.text.mrope_section:
      raise ValueError("QwenVLConfig: the text config needs an mrope_section (M-RoPE)")
    if self.vision.out_width != self.text.width:
      raise ValueError(f"QwenVLConfig: the vision tower's out_width {self.vision.out_width} is "
                       f"not the language model's width {self.text.width}")
    if not 0 <= self.image_token_id < self.text.vocab_size:
      raise ValueError(f"QwenVLConfig.image_token_id = {self.image_token_id} is not in the "
                       f"vocabulary of {self.text.vocab_size}")

  @property
  def family(self) -> str:
    return self.vision.family


# -- config.json --------------------------------------------------------------------
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # config.json model_type of the two families


def config_from_hf(hf_config: dict[str, Any], **overrides) -> QwenVLConfig:
  """From a Qwen2-VL / Qwen2.5-VL config.json dict: transformers 5's (text_config
  nested, rope_parameters) or the released checkpoints' (text keys at the top,
  rope_scaling {type: mrope}). `overrides` go to the text DecoderConfig; `dtype`,
  `param_dtype` and `scan_layers` to the vision tower too. Missing keys take transformers'
  Qwen2VLTextConfig defaults where the released configs might leave them out."""
  vision = qv_hf.config_from_hf(hf_config, **{k: v for k, v in overrides.items()
                                           if k in ("dtype", "param_dtype", "scan_layers")})
  text = hf_config.get("text_config") or hf_config
  if text.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"config.json: hidden_act={text['hidden_act']!r}; only 'silu' is "
                          "supported")
  if text.get("use_sliding_window"):
    raise CheckpointError("config.json: use_sliding_window=true is not supported")
  # transformers reads rope_scaling first, then rope_parameters; 'mrope' means default.
  rp = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
  rope_type = rp.get("rope_type", rp.get("type", "default"))
  if rope_type not in ("default", "mrope"):
    raise CheckpointError(f"config.json: rope_type={rope_type!r} is not supported (default, "
                          "mrope)")
  heads = int(text["num_attention_heads"])
  kv_heads = text.get("num_key_value_heads", 8) or heads
  kw = dict(
      vocab_size=int(text["vocab_size"]), width=int(text["hidden_size"]),
      depth=int(text["num_hidden_layers"]), heads=heads, kv_heads=int(kv_heads),
      mlp_width=int(text["intermediate_size"]),
      # transformers' attention takes hidden_size / heads whatever head_dim says.
      head_dim=int(text["hidden_size"]) // heads,
      rope_theta=float(rp.get("rope_theta", text.get("rope_theta", 1e6))),
      norm_eps=float(text.get("rms_norm_eps", 1e-5)),
      # transformers 5 keeps it at the top; older saves put it in text_config.
      tie_embeddings=bool(hf_config.get("tie_word_embeddings") or
                          text.get("tie_word_embeddings")),
      qkv_bias=True, max_positions=int(text.get("max_position_embeddings", 32768)),
      family="qwen2", mrope_section=tuple(int(s) for s in rp.get("mrope_section", (16, 24, 24))))
  kw.update(overrides)
  try:
    return QwenVLConfig(DecoderConfig(**kw), vision,
                        int(hf_config.get("image_token_id", 151655)))
  except ValueError as e:
    raise CheckpointError(f"config.json: {e}") from None


ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def config_to_hf(config: QwenVLConfig, dtype: str, **extra) -> dict[str, Any]:
  """A config.json dict in transformers 5's layout (text_config with rope_parameters,
  vision_config) that `config_from_hf` and transformers both read back. `extra`: the
  keys this config does not hold (vision_start_token_id, ...; `save` copies them from
  the source checkpoint when given)."""
  t, v = config.text, config.vision
  if t.family != "qwen2" or not t.qkv_bias or t.qk_norm or t.dim_per_head != t.width // t.heads:
    raise CheckpointError(f"the text config (family {t.family!r}, qkv_bias {t.qkv_bias}, "
                          f"qk_norm {t.qk_norm}, head_dim {t.dim_per_head}) is not a Qwen2-VL "
                          "language model")
  text = {"model_type": f"{v.family}_text", "vocab_size": t.vocab_size, "hidden_size": t.width,
          "intermediate_size": t.mlp_width, "num_hidden_layers": t.depth,
          "num_attention_heads": t.heads, "num_key_value_heads": t.num_kv_heads,
          "hidden_act": "silu", "rms_norm_eps": t.norm_eps,
          "max_position_embeddings": t.max_positions, "use_sliding_window": False,
          "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                              "mrope_section": list(t.mrope_section)}}
  vision = {"model_type": f"{v.family}_vision" if v.family == "qwen2_vl" else v.family,
            "depth": v.depth, "num_heads": v.heads, "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size, "spatial_merge_size": v.merge,
            "in_channels": v.channels, "hidden_act": v.act}
  if v.family == "qwen2_vl":
    ratio = v.mlp_width // v.width if v.mlp_width % v.width == 0 else v.mlp_width / v.width
    vision.update(embed_dim=v.width, hidden_size=v.out_width, mlp_ratio=ratio)  # int if whole
  else:
    vision.update(hidden_size=v.width, intermediate_size=v.mlp_width, out_hidden_size=v.out_width,
                  window_size=v.window_size, fullatt_block_indexes=list(v.full_attention_layers))
  return {"architectures": [ARCHITECTURES[v.family]], "model_type": v.family, "dtype": dtype,
          "image_token_id": config.image_token_id, "tie_word_embeddings": t.tie_embeddings,
          "text_config": text, "vision_config": vision, **extra}


# -- M-RoPE positions (host) ------------------------------------------------------------
def _host(x, what: str) -> np.ndarray:
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    raise ValueError(f"{what} must be host data (numpy) here: M-RoPE positions depend on it; "
                     "under jit compute them with qwen_vl.mrope_positions outside and pass "
                     "positions= and rope_delta=") from None


def mrope_positions(input_ids, image_grid_thw, config: QwenVLConfig,
                    attention_mask=None) -> tuple[np.ndarray, np.ndarray]:
  """(positions [3, B, S] int32, rope_delta [B] int32), as transformers'
  get_rope_index gives them for images: padding (attention_mask 0) at 0, each row's
  real tokens laid out from 0, an image's tokens at (start + t, start + row, start +
  column) of its merged grid, the text after it from start + max(h, w) / merge.
  `image_grid_thw` [n, 3] lists the batch's images in order, row by row. Raises a
  ValueError naming the row and the counts when a run of image-pad tokens is not
  the size of its image, or the images and the runs do not pair up."""
  ids = _host(input_ids, "input_ids")
  if ids.ndim != 2:
    raise ValueError(f"input_ids has shape {ids.shape}; it must be [batch, length]")
  B, S = ids.shape
  mask = (np.ones((B, S), bool) if attention_mask is None
          else _host(attention_mask, "attention_mask").astype(bool))
  grid = (np.zeros((0, 3), np.int64) if image_grid_thw is None
          else qv.check_grid(config.vision, image_grid_thw))
  m = config.vision.merge
  positions = np.zeros((3, B, S), np.int64)
  delta = np.zeros(B, np.int64)
  image = 0
  for b in range(B):
    row = ids[b, mask[b]]
    is_image = row == config.image_token_id
    runs = np.flatnonzero(np.r_[True, is_image[1:] != is_image[:-1]]) if len(row) else []
    ends = np.r_[runs[1:], len(row)] if len(row) else []
    parts, start = [], 0
    for i, j in zip(runs, ends):
      if not is_image[i]:
        parts.append(np.broadcast_to(np.arange(start, start + j - i), (3, j - i)))
        start += j - i
        continue
      if image == len(grid):
        raise ValueError(f"row {b}: a run of image-pad tokens at {i} has no image: "
                         f"image_grid_thw has only {len(grid)} image(s)")
      t, h, w = (int(v) for v in grid[image])
      need = t * h * w // m ** 2
      if j - i != need:
        raise ValueError(f"row {b}: image {image} has {j - i} image-pad tokens at {i}; its "
                         f"image_grid_thw {(t, h, w)} makes {need} merged patches")
      tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
      parts.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + start)
      start += max(h, w) // m
      image += 1
    if parts:
      laid = np.concatenate(parts, axis=1)
      positions[:, b, mask[b]] = laid
      delta[b] = laid.max() + 1 - len(row)
  if image != len(grid):
    raise ValueError(f"image_grid_thw has {len(grid)} images; the prompts have {image} runs of "
                     "image-pad tokens")
  return positions.astype(np.int32), delta.astype(np.int32)


# -- the model --------------------------------------------------------------------------
class QwenVLCache(NamedTuple):
  """The decoder's caches (a list of per-layer (k, v), or one stacked (k, v) with
  scan_layers) and each row's rope delta [B]."""
  layers: Any
  rope_delta: jax.Array


class QwenVL(nnx.Module):
  """input_ids [B, T], attention_mask [B, T], pixel_values [patches, C*T*P*P] and
  image_grid_thw [images, 3] (host ints) -> logits [B, T, vocab]."""

  def __init__(self, config: QwenVLConfig, rngs: nnx.Rngs):
    self.config = config
    self.visual = qv.QwenVisionTower(config.vision, rngs)
    self.decoder = DecoderLM(config.text, rngs)

  def encode(self, pixel_values, image_grid_thw):
    """The images' merged embeddings [sum of t*h*w / merge^2, width], image by image."""
    return self.visual(pixel_values, image_grid_thw)

  def embed(self, tokens, image_embeds=None):
    """Token embeddings with the k-th image-pad token (row-major over the batch) taking
    image_embeds[k]. With host tokens the counts are checked here; under jit it is
    mrope_positions, run on the same tokens, that checks them.

    image_embeds may instead be [B, T, width], aligned with the tokens: each image-pad
    token takes its own row and the rest is ignored. The encode-once step gathers it
    from the mini-batch's unique images (multimodal/qwen_images.py); unlike the
    row-major form it needs no count across rows, so it stays local to a batch shard."""
    x = self.decoder.embed(tokens)
    if image_embeds is None:
      return x
    is_image = tokens == self.config.image_token_id
    if image_embeds.ndim == 3:
      if image_embeds.shape[:2] != tokens.shape:
        raise ValueError(f"image_embeds has shape {tuple(image_embeds.shape)}; aligned with "
                         f"tokens {tuple(tokens.shape)} it must be [B, T, width]")
      return jnp.where(is_image[..., None], image_embeds.astype(x.dtype), x)
    try:
      count = int(np.sum(np.asarray(is_image)))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
      count = None
    if count is not None and count != image_embeds.shape[0]:
      raise ValueError(f"the prompts have {count} image-pad tokens (id "
                       f"{self.config.image_token_id}) but the images have "
                       f"{image_embeds.shape[0]} merged patches")
    k = jnp.cumsum(is_image.reshape(-1)).reshape(is_image.shape) - 1
    rows = image_embeds[jnp.clip(k, 0, image_embeds.shape[0] - 1)].astype(x.dtype)
    return jnp.where(is_image[..., None], rows, x)

  def _image_embeds(self, pixel_values, image_grid_thw, image_embeds):
    if pixel_values is not None and image_embeds is not None:
      raise ValueError("pass pixel_values or image_embeds, not both")
    if pixel_values is not None:
      return self.encode(pixel_values, image_grid_thw)
    return image_embeds

  def __call__(self, tokens, attention_mask, pixel_values=None, image_grid_thw=None, *,
               positions=None, image_embeds=None, segment_ids=None, hidden: bool = False):
    """`positions` [3, B, T] from mrope_positions (computed here from host tokens when
    not given); `image_embeds`, the output of `encode` (or [B, T, width] aligned with the
    tokens, see `embed`), in place of pixel_values. `segment_ids` [B, T]: packed rows
    (the decoder's), `positions` then restarting per segment
    (qwen_images.packed_image_fields). `hidden`: the decoder's `Hidden` (the train
    step's chunked log-probs) in place of the logits."""
    if positions is None:
      positions, _ = mrope_positions(tokens, image_grid_thw, self.config, attention_mask)
    x = self.embed(tokens, self._image_embeds(pixel_values, image_grid_thw, image_embeds))
    return self.decoder(tokens, attention_mask, positions=jnp.asarray(positions), embeds=x,
                        segment_ids=segment_ids, hidden=hidden)

  # -- incremental decoding (the rollout sampler) -----------------------------
  def prefill(self, tokens, valid, capacity: int, pixel_values=None, image_grid_thw=None, *,
              positions=None, rope_delta=None, image_embeds=None):
    """The decoder's prefill with the images' embeddings in place and M-RoPE positions
    (and `rope_delta`, both from mrope_positions; computed here from host tokens when
    not given). Returns the last position's logits and a QwenVLCache."""
    if positions is None:
      positions, rope_delta = mrope_positions(tokens, image_grid_thw, self.config, valid)
    elif rope_delta is None:
      raise ValueError("prefill: positions without rope_delta (mrope_positions returns both)")
    x = self.embed(tokens, self._image_embeds(pixel_values, image_grid_thw, image_embeds))
    logits, layers = self.decoder.prefill(tokens, valid, capacity,
                                          positions=jnp.asarray(positions), embeds=x)
    return logits, QwenVLCache(layers, jnp.asarray(rope_delta, jnp.int32))

  def decode_step(self, token, position, cache: QwenVLCache, index, key_valid):
    """As DecoderLM.decode_step; `position` [B] is the text position (the row's real
    tokens before this one), to which the row's rope delta is added."""
    logits, layers = self.decoder.decode_step(token, position + cache.rope_delta, cache.layers,
                                              index, key_valid)
    return logits, QwenVLCache(layers, cache.rope_delta)


# -- loading ----------------------------------------------------------------------------
def abstract_model(config: QwenVLConfig):
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: QwenVL(config, nnx.Rngs(0)))


def load(path: str, dtype: str = "float32", *, mesh=None, rules=None,
         **overrides) -> tuple[QwenVL, QwenVLConfig]:
  """Loads a Qwen2-VL / Qwen2.5-VL directory onto the mesh.

  The language model's tensors are `model.*` (as transformers 5 saves them and the
  released checkpoints have them) or `model.language_model.*` (transformers' module
  names), plus `lm_head.weight` unless the embeddings are tied; they are read as
  hf.load reads a decoder's (each device reads its own slice). The vision tower
  comes from `visual.*` / `model.visual.*` (qwen_vision_hf.load). `dtype` sets both
  parts' parameters and activations; `overrides` go to the text DecoderConfig
  (`param_dtype` to the tower too). Errors name the tensor and both shapes."""
  overrides = {"dtype": dtype, "param_dtype": dtype, **overrides}
  config = config_from_hf(read_config(path), **overrides)
  mesh, rules = mesh_or_default(mesh, rules)  # one mesh for both parts
  names = CheckpointDir(path).names
  prefix = ("model.language_model." if any(n.startswith("model.language_model.") for n in names)
            else "model.")
  decoder = hf.load_weights(path, config.text, mesh=mesh, rules=rules, prefix=prefix,
                            owns=lambda n: not n.startswith(qv_hf.PREFIXES))
  tower, vision = qv_hf.load(path, dtype, mesh=mesh, rules=rules,
                          param_dtype=overrides["param_dtype"],
                          scan_layers=config.vision.scan_layers)
  assert vision == config.vision, (vision, config.vision)
  graphdef, _ = nnx.split(abstract_model(config))
  state = nnx.State({"visual": nnx.state(tower), "decoder": nnx.state(decoder)})
  return nnx.merge(graphdef, state), config


def save(model: QwenVL, path: str, dtype: str | None = None, *, like: str | None = None,
         max_shard_bytes: int = 4 << 30) -> list[str]:
  """Writes `model` as a Qwen2-VL / Qwen2.5-VL directory transformers loads
  (config.json, model*.safetensors: `model.*` and `lm_head.weight` as hf.save writes
  a decoder's, `visual.*` with q, k, v fused back into qkv). `like`: a checkpoint
  whose vision start / end and video token ids (and other keys this config lacks) are
  copied into config.json. Returns the files written."""
  config = model.config
  dtype = dtype or config.text.param_dtype
  extra = {}
  if like is not None:
    src = read_config(like)
    extra = {k: src[k] for k in ("vision_start_token_id", "vision_end_token_id",
                                 "video_token_id", "bos_token_id", "eos_token_id")
             if k in src}
  params = nnx.state(model, nnx.Param)
  tensors = {**hf.decoder_tensors(params["decoder"]),
             **qv_hf.hf_tensors(params["visual"], config.vision)}
  return write_checkpoint(path, tensors, config_to_hf(config, dtype, **extra), dtype,
                             max_shard_bytes)
