"""Transformer building blocks (Flax NNX). Every parameter carries logical axis names.

Logical axes: 'vocab', 'embed' (model width), 'heads' (attention heads x head dim),
'mlp' (feed-forward width), 'patch' (flattened image patch). Mesh layouts map them
to mesh axes (configs/mesh/*.gin, knittrans_jax/train/mesh.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

_normal = nnx.initializers.normal(stddev=0.02)


def wide(dtype) -> jnp.dtype:
  """The dtype for numerically sensitive math: float32, or float64 under x64 tests."""
  return jnp.promote_types(dtype, jnp.float32)


def dense(rngs: nnx.Rngs, din: int, dout: int, axes: tuple[str, str], dtype) -> nnx.Linear:
  return nnx.Linear(din, dout, use_bias=False, dtype=dtype,
                    kernel_init=nnx.with_partitioning(_normal, axes), rngs=rngs)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float = 1e-6):
    self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, ("embed",))(
        jax.random.key(0), (dim,)))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(wide(x.dtype))
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding on [B, T, H, D] at integer positions [B, T]."""
  d = x.shape[-1]
  dt = wide(x.dtype)
  freqs = theta ** (-jnp.arange(0, d, 2, dtype=dt) / d)
  angle = positions[..., None].astype(dt) * freqs  # [B, T, D/2]
  cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
  x1, x2 = x[..., 0::2].astype(dt), x[..., 1::2].astype(dt)
  out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)


class Attention(nnx.Module):
  """Multi-head attention; `mask` [B, Tq, Tk] is True where attending is allowed."""

  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs, dtype, rope_theta: float | None):
    if dim % heads:
      raise ValueError(f"width {dim} is not divisible by {heads} heads")
    self.heads, self.head_dim, self.rope_theta = heads, dim // heads, rope_theta
    self.q = dense(rngs, dim, dim, ("embed", "heads"), dtype)
    self.k = dense(rngs, dim, dim, ("embed", "heads"), dtype)
    self.v = dense(rngs, dim, dim, ("embed", "heads"), dtype)
    self.o = dense(rngs, dim, dim, ("heads", "embed"), dtype)

  def _qkv(self, x, positions):
    B, T, _ = x.shape
    split = lambda y: y.reshape(B, T, self.heads, self.head_dim)
    q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
    if self.rope_theta is not None:
      q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
    return q, k, v

  def _attend(self, q, k, v, mask):
    dt = wide(q.dtype)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(dt) / jnp.sqrt(self.head_dim).astype(dt)
    scores = jnp.where(mask[:, None], scores, jnp.finfo(dt).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return self.o(out.reshape(out.shape[0], out.shape[1], -1))

  def __call__(self, x, mask, positions=None, cache=None, index=None):
    """Full attention; with `cache` (k, v of [B, S, H, D]) the new keys and values
    are written at `index` and the queries attend over the cache (decoding)."""
    q, k, v = self._qkv(x, positions)
    if cache is None:
      return self._attend(q, k, v, mask), (k, v)
    ck = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (0, index, 0, 0))
    cv = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (0, index, 0, 0))
    return self._attend(q, ck, cv, mask), (ck, cv)


class MLP(nnx.Module):
  """SwiGLU feed-forward."""

  def __init__(self, dim: int, hidden: int, rngs: nnx.Rngs, dtype):
    self.gate = dense(rngs, dim, hidden, ("embed", "mlp"), dtype)
    self.up = dense(rngs, dim, hidden, ("embed", "mlp"), dtype)
    self.down = dense(rngs, hidden, dim, ("mlp", "embed"), dtype)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, hidden: int, rngs: nnx.Rngs, dtype,
               rope_theta: float | None, dropout: float = 0.0):
    self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
    self.attn = Attention(dim, heads, rngs, dtype, rope_theta)
    self.mlp = MLP(dim, hidden, rngs, dtype)
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

  def __call__(self, x, mask, positions=None, cache=None, index=None):
    """Returns the block output and this layer's (k, v) (the updated cache if given)."""
    h, kv = self.attn(self.norm1(x), mask, positions, cache, index)
    if self.dropout is not None:
      h = self.dropout(h)
    x = x + h
    return x + self.mlp(self.norm2(x)), kv
