"""A small ViT encoder (patch embedding + bidirectional blocks) and its projector."""
from __future__ import annotations

import dataclasses

import gin
import jax.numpy as jnp
from flax import nnx

from knittrans_jax.models.layers import Block, RMSNorm, _normal, dense


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ViTConfig:
  image_size: int = 32
  patch_size: int = 8
  channels: int = 3
  width: int = 64
  depth: int = 2
  heads: int = 4
  mlp_width: int = 128
  dropout: float = 0.0  # > 0 makes the encoder stochastic (refused by encode-once)
  dtype: str = "float32"
  # The projector concatenates merge x merge neighbouring patches into one LM token
  # (Qwen2-VL's 2 x 2 merge: a 448 image, 14-pixel patches -> 1024 ViT, 256 LM tokens).
  merge: int = 1

  def __post_init__(self):
    if self.image_size % self.patch_size:
      raise ValueError(f"ViTConfig: image_size {self.image_size} is not a multiple of "
                       f"patch_size {self.patch_size}")
    if self.merge < 1 or (self.image_size // self.patch_size) % self.merge:
      raise ValueError(f"ViTConfig.merge = {self.merge} must be >= 1 and divide the "
                       f"{self.image_size // self.patch_size} patches per side")

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def num_tokens(self) -> int:
    """Image tokens the language model sees per image."""
    return self.num_patches // self.merge ** 2


class ViTEncoder(nnx.Module):
  """images [B, H, W, C] (float) -> patch features [B, num_patches, width]."""

  def __init__(self, config: ViTConfig, rngs: nnx.Rngs):
    self.config = config
    p, c = config.patch_size, config.channels
    dt = jnp.dtype(config.dtype)
    self.patch = dense(rngs, p * p * c, config.width, ("patch", "embed"), dt)
    self.pos = nnx.Param(nnx.with_partitioning(_normal, (None, "embed"))(
        rngs.params(), (config.num_patches, config.width)))
    self.blocks = nnx.List([Block(config.width, config.heads, config.mlp_width, rngs, dt,
                                  rope=None, dropout=config.dropout)
                            for _ in range(config.depth)])
    self.norm = RMSNorm(config.width)

  def __call__(self, images):
    cfg = self.config
    B, H, W, C = images.shape
    if (H, W, C) != (cfg.image_size, cfg.image_size, cfg.channels):
      raise ValueError(f"images of shape {images.shape[1:]} do not match ViTConfig "
                       f"({cfg.image_size}, {cfg.image_size}, {cfg.channels})")
    p = cfg.patch_size
    x = images.reshape(B, H // p, p, W // p, p, C).transpose(0, 1, 3, 2, 4, 5)
    x = self.patch(x.reshape(B, cfg.num_patches, p * p * C)) + self.pos[...]
    mask = jnp.ones((B, cfg.num_patches, cfg.num_patches), bool)  # bidirectional
    for block in self.blocks:
      x, _ = block(x, mask)
    return self.norm(x)


class Projector(nnx.Module):
  """ViT features [B, patches, din] -> LM tokens [B, patches / merge^2, dout]: each
  merge x merge block of neighbouring patches is concatenated, then two layers, GELU."""

  def __init__(self, din: int, dout: int, rngs: nnx.Rngs, dtype="float32", merge: int = 1):
    self.merge = merge
    self.fc1 = dense(rngs, din * merge * merge, dout, (None, "embed"), jnp.dtype(dtype))
    self.fc2 = dense(rngs, dout, dout, ("mlp", "embed"), jnp.dtype(dtype))

  def __call__(self, x):
    m = self.merge
    if m > 1:
      B, N, D = x.shape
      g = int(round(N ** 0.5))
      x = x.reshape(B, g // m, m, g // m, m, D).transpose(0, 1, 3, 2, 4, 5)
      x = x.reshape(B, (g // m) ** 2, m * m * D)
    return self.fc2(nnx.gelu(self.fc1(x)))
