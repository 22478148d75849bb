"""A small decoder-only transformer (RoPE, RMSNorm, causal attention with padding)."""
from __future__ import annotations

import dataclasses

import gin
import jax.numpy as jnp
from flax import nnx

from knittrans_jax.models.layers import wide, Block, RMSNorm, _normal, dense


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Defaults run a training step on this CPU in well under a second."""
  vocab_size: int = 256
  width: int = 128
  depth: int = 2
  heads: int = 4
  mlp_width: int = 384
  rope_theta: float = 10000.0
  dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "width", "depth", "heads", "mlp_width"):
      if getattr(self, name) <= 0:
        raise ValueError(f"DecoderConfig.{name} = {getattr(self, name)} must be positive")
    if self.width % self.heads or (self.width // self.heads) % 2:
      raise ValueError(f"DecoderConfig: width {self.width} / heads {self.heads} must be an even int")


class DecoderLM(nnx.Module):
  """tokens [B, T] (+ optional prefix embeddings [B, P, width]) -> logits [B, T, vocab].

  `attention_mask` [B, T] marks real (non-padding) tokens. A prefix (e.g. projected
  image embeddings) is placed before the tokens and attended to by every token;
  logits are returned for the token positions only.
  """

  def __init__(self, config: DecoderConfig, rngs: nnx.Rngs):
    self.config = config
    dt = jnp.dtype(config.dtype)
    self.embed = nnx.Embed(config.vocab_size, config.width, dtype=dt,
                           embedding_init=nnx.with_partitioning(_normal, ("vocab", "embed")),
                           rngs=rngs)
    self.blocks = nnx.List([Block(config.width, config.heads, config.mlp_width, rngs, dt,
                                  config.rope_theta) for _ in range(config.depth)])
    self.norm = RMSNorm(config.width)
    self.head = dense(rngs, config.width, config.vocab_size, ("embed", "vocab"), dt)

  def __call__(self, tokens, attention_mask, prefix=None, prefix_mask=None):
    x = self.embed(tokens)
    valid = attention_mask.astype(bool)
    if prefix is not None:
      P = prefix.shape[1]
      pmask = (jnp.ones(prefix.shape[:2], bool) if prefix_mask is None
               else prefix_mask.astype(bool))
      x = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
      valid = jnp.concatenate([pmask, valid], axis=1)
    else:
      P = 0
    T = x.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = causal[None] & valid[:, None, :]
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    for block in self.blocks:
      x, _ = block(x, mask, positions)
    return self.head(self.norm(x[:, P:])).astype(wide(x.dtype))

  # -- incremental decoding (the rollout sampler) -----------------------------
  def prefill(self, tokens, valid, capacity: int, prefix=None):
    """Runs the prompt; returns the last position's logits and a KV cache of
    `capacity` positions per layer. Prompts are left-padded (`valid` False on pads).
    A prefix [B, Q, width] (image embeddings) fills cache slots 0..Q-1, as in training."""
    x = self.embed(tokens)
    if prefix is not None:
      x = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
      valid = jnp.concatenate([jnp.ones(prefix.shape[:2], bool), valid], axis=1)
    B, T = x.shape[:2]
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :]
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    caches = []
    for block in self.blocks:
      x, (k, v) = block(x, mask, positions)
      pad = ((0, 0), (0, capacity - T), (0, 0), (0, 0))
      caches.append((jnp.pad(k, pad), jnp.pad(v, pad)))
    return self.head(self.norm(x[:, -1:]))[:, 0].astype(wide(x.dtype)), caches

  def decode_step(self, token, position, caches, index, key_valid):
    """One token per row at cache slot `index`; `key_valid` [B, S] marks filled slots."""
    x = self.embed(token[:, None])
    mask = key_valid[:, None, :]
    new = []
    for block, cache in zip(self.blocks, caches):
      x, kv = block(x, mask, position[:, None], cache, index)
      new.append(kv)
    return self.head(self.norm(x))[:, 0].astype(wide(x.dtype)), new
