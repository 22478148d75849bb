"""The decoder-only transformer: the tiny default and the Qwen2/2.5, Qwen3 and Llama 3
families in one config (GQA, q/k/v bias, per-head q/k norm, tied embeddings, Llama 3
RoPE scaling, Qwen2-VL's M-RoPE). Real checkpoints load through knittrans_jax/models/hf.py
(and models/qwen_vl.py for Qwen2-VL / Qwen2.5-VL)."""
from __future__ import annotations

import dataclasses

import gin
import jax
import jax.numpy as jnp
from flax import nnx

from knittrans_jax.hidden import Hidden, Projection
from knittrans_jax.models import scan as layer_scan
from knittrans_jax.models.blockwise_attention import RowMask
from knittrans_jax.models.layers import (ATTENTION_IMPLS, DTYPES, Block, RMSNorm, Rope, _normal,
                                         dense, wide)

FAMILIES = ("toy", "qwen2", "qwen3", "llama")
ROPE_TYPES = ("default", "llama3")
# jax.checkpoint policies for decoder blocks: what the backward pass may keep.
REMAT_POLICIES = {
    "none": None,  # no rematerialisation: every activation kept
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Defaults run a training step on this CPU in well under a second.

  `dtype` is the activation (compute) dtype, `param_dtype` the stored parameters'.
  `kv_heads` 0 means as many as `heads`; `head_dim` 0 means width // heads.
  `family` names the Hugging Face format `hf.save` writes ('toy' is written as Llama).
  `mrope_section` (Qwen2-VL's M-RoPE, e.g. (16, 24, 24), summing to head dim / 2) lets
  the forward take (temporal, height, width) positions [3, B, T]; empty is plain RoPE.
  `attention` picks the attention (layers.ATTENTION_IMPLS): 'blockwise' computes the
  training forward in tiles of `attention_block` tokens (models/blockwise_attention.py),
  for long (packed) rows whose [heads, T, T] scores would not fit.
  `scan_layers` holds the blocks as one stack (a leading 'layers' axis on each
  parameter) run by one lax.scan (models/scan.py): the same values, a compile time
  that does not grow with depth; the real-model configs (configs/models/) set it.
  """
  vocab_size: int = 256
  width: int = 128
  depth: int = 2
  heads: int = 4
  mlp_width: int = 384
  rope_theta: float = 10000.0
  dtype: str = "float32"
  kv_heads: int = 0
  head_dim: int = 0
  qkv_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = False
  norm_eps: float = 1e-6
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  max_positions: int = 4096
  param_dtype: str = "float32"
  remat: str = "none"
  attention: str = "einsum"
  attention_block: int = 512
  family: str = "toy"
  mrope_section: tuple[int, ...] = ()
  scan_layers: bool = False

  def __post_init__(self):
    object.__setattr__(self, "mrope_section", tuple(self.mrope_section))  # gin gives lists
    for name in ("vocab_size", "width", "depth", "heads", "mlp_width", "max_positions",
                 "attention_block"):
      if getattr(self, name) <= 0:
        raise ValueError(f"DecoderConfig.{name} = {getattr(self, name)} must be positive")
    if not self.head_dim and self.width % self.heads:
      raise ValueError(f"DecoderConfig: width {self.width} is not divisible by heads {self.heads}"
                       " (or set head_dim)")
    if self.dim_per_head % 2:
      raise ValueError(f"DecoderConfig: head dim {self.dim_per_head} must be even for RoPE")
    if self.kv_heads < 0 or self.heads % self.num_kv_heads:
      raise ValueError(f"DecoderConfig: heads {self.heads} is not a multiple of kv_heads "
                       f"{self.kv_heads}")
    for name, allowed in (("dtype", DTYPES), ("param_dtype", DTYPES), ("remat", REMAT_POLICIES),
                          ("attention", ATTENTION_IMPLS), ("family", FAMILIES),
                          ("rope_type", ROPE_TYPES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"DecoderConfig.{name} = {getattr(self, name)!r} is not one of "
                         f"{tuple(allowed)}")
    if self.rope_type == "llama3" and not (self.rope_factor > 0 and
                                          self.rope_high_freq_factor > self.rope_low_freq_factor > 0):
      raise ValueError(f"DecoderConfig: llama3 RoPE needs factor > 0 and high_freq_factor "
                       f"{self.rope_high_freq_factor} > low_freq_factor {self.rope_low_freq_factor} > 0")
    if self.mrope_section and (min(self.mrope_section) <= 0 or
                               sum(self.mrope_section) != self.dim_per_head // 2):
      raise ValueError(f"DecoderConfig.mrope_section = {self.mrope_section} must be positive and "
                       f"sum to head dim / 2 = {self.dim_per_head // 2}")

  @property
  def num_kv_heads(self) -> int:
    return self.kv_heads or self.heads

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.width // self.heads

  @property
  def rope(self) -> Rope:
    scaling = None
    if self.rope_type == "llama3":
      scaling = (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                 self.rope_original_max_positions)
    return Rope(self.rope_theta, scaling, self.mrope_section)


class DecoderLM(nnx.Module):
  """tokens [B, T] (+ optional prefix embeddings [B, P, width]) -> logits [B, T, vocab].

  `attention_mask` [B, T] marks real (non-padding) tokens. A prefix (e.g. projected
  image embeddings) is placed before the tokens and attended to by every token;
  logits are returned for the token positions only.

  By default RoPE positions count the real tokens from 0. `positions` overrides them
  ([B, T'], or [3, B, T'] with `mrope_section`; T' counts the prefix too), and
  `embeds` [B, T, width] replaces embed(tokens) (a Qwen2-VL prompt with the image
  embeddings scattered in: models/qwen_vl.py).
  """

  def __init__(self, config: DecoderConfig, rngs: nnx.Rngs):
    self.config = config
    dt, pdt = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    self.embed = nnx.Embed(config.vocab_size, config.width, dtype=dt, param_dtype=pdt,
                           embedding_init=nnx.with_partitioning(_normal, ("vocab", "embed")),
                           rngs=rngs)

    def block(r):
      return Block(config.width, config.heads, config.mlp_width, r, dt, config.rope,
                   norm_eps=config.norm_eps, param_dtype=pdt, kv_heads=config.num_kv_heads,
                   head_dim=config.dim_per_head, qkv_bias=config.qkv_bias,
                   qk_norm=config.qk_norm, impl=config.attention, block=config.attention_block)
    self.blocks = (layer_scan.stack(block, config.depth, rngs) if config.scan_layers else
                   nnx.List([block(rngs) for _ in range(config.depth)]))
    self.norm = RMSNorm(config.width, config.norm_eps, param_dtype=pdt)
    self.head = (None if config.tie_embeddings else
                 dense(rngs, config.width, config.vocab_size, ("embed", "vocab"), dt,
                       param_dtype=pdt))

  def _logits(self, x):
    return self.project(self.norm(x))

  def project(self, h):
    """Final (normed) hidden states [..., width] -> logits [..., vocab], wide dtype."""
    out = self.embed.attend(h) if self.head is None else self.head(h)
    return out.astype(wide(h.dtype))

  def projection(self) -> "Projection":
    """The output head as a pure function of its own parameters: what the train step's
    chunked log-probs call per chunk (rl/losses.chunked_token_logprobs), so no
    [B, T, vocab] array is ever formed there."""
    module = self.embed if self.head is None else self.head
    graphdef, state = nnx.split(module)
    if self.head is None:
      return Projection(lambda st, h: nnx.merge(graphdef, st).attend(h).astype(wide(h.dtype)),
                        state)
    return Projection(lambda st, h: nnx.merge(graphdef, st)(h).astype(wide(h.dtype)), state)

  def _run_blocks(self, x, mask, positions):
    policy = REMAT_POLICIES[self.config.remat]
    if self.config.scan_layers:
      x, _ = layer_scan.scan(self.blocks, lambda blk, h, _: (blk(h, mask, positions)[0], None),
                             x, policy=policy, remat=self.config.remat != "none")
      return x
    if self.config.remat == "none":
      for block in self.blocks:
        x, _ = block(x, mask, positions)
      return x
    # Rematerialise each block: the backward pass recomputes what `policy` drops.
    run = nnx.remat(lambda blk, h: blk(h, mask, positions)[0], policy=policy)
    for block in self.blocks:
      x = run(block, x)
    return x

  def __call__(self, tokens, attention_mask, prefix=None, prefix_mask=None, *, positions=None,
               embeds=None, segment_ids=None, hidden: bool = False):
    """hidden: return `Hidden` (the normed final states of the token positions and
    the head) instead of the logits. `segment_ids` [B, T]: packed rows, several
    sequences a row (job/batching.build_packed_batch); a token attends only to
    earlier tokens of its own segment, and `positions` should restart per segment."""
    x = self.embed(tokens) if embeds is None else embeds
    valid = attention_mask.astype(bool)
    if prefix is not None:
      P = prefix.shape[1]
      pmask = (jnp.ones(prefix.shape[:2], bool) if prefix_mask is None
               else prefix_mask.astype(bool))
      x = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
      valid = jnp.concatenate([pmask, valid], axis=1)
    else:
      P = 0
    if segment_ids is not None and prefix is not None:
      raise ValueError("segment_ids with a prefix: a packed row has no one prefix")
    mask = RowMask(valid, segment_ids)
    if self.config.attention != "blockwise":
      mask = mask.dense()  # built once, not in every layer
    if positions is None:
      positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    x = self._run_blocks(x, mask, positions)
    if hidden:
      return Hidden(self.norm(x[:, P:]), self.projection())
    return self._logits(x[:, P:])

  # -- incremental decoding (the rollout sampler) -----------------------------
  def prefill(self, tokens, valid, capacity: int, prefix=None, *, positions=None, embeds=None):
    """Runs the prompt; returns the last position's logits and a KV cache of
    `capacity` positions per layer (a list of (k, v), or one stacked (k, v) with
    scan_layers). Prompts are left-padded (`valid` False on pads).
    A prefix [B, Q, width] (image embeddings) fills cache slots 0..Q-1, as in training.
    `positions` and `embeds` as in __call__."""
    x = self.embed(tokens) if embeds is None else embeds
    if prefix is not None:
      x = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
      valid = jnp.concatenate([jnp.ones(prefix.shape[:2], bool), valid], axis=1)
    B, T = x.shape[:2]
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :]
    if positions is None:
      positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    pad = ((0, 0), (0, capacity - T), (0, 0), (0, 0))

    def layer(block, h, _):
      h, (k, v) = block(h, mask, positions)
      return h, (jnp.pad(k, pad), jnp.pad(v, pad))

    if self.config.scan_layers:  # the caches stacked too: (k, v) of [L, B, S, kv_heads, D]
      x, caches = layer_scan.scan(self.blocks, layer, x)
    else:
      caches = []
      for block in self.blocks:
        x, kv = layer(block, x, None)
        caches.append(kv)
    return self._logits(x[:, -1:])[:, 0], caches

  def decode_step(self, token, position, caches, index, key_valid):
    """One token per row at cache slot `index`; `key_valid` [B, S] marks filled slots.
    `position` [B] (or [3, B] with M-RoPE) is the token's RoPE position."""
    x = self.embed(token[:, None])
    mask = key_valid[:, None, :]
    if self.config.scan_layers:
      x, new = layer_scan.scan(
          self.blocks, lambda blk, h, kv: blk(h, mask, position[..., None], kv, index), x, caches)
      return self._logits(x)[:, 0], new
    new = []
    for block, cache in zip(self.blocks, caches):
      x, kv = block(x, mask, position[..., None], cache, index)
      new.append(kv)
    return self._logits(x)[:, 0], new
