"""Transformer building blocks (Flax NNX). Every parameter carries logical axis names.

Logical axes: 'vocab', 'embed' (model width), 'heads' (attention heads x head dim),
'mlp' (feed-forward width), 'patch' (flattened image patch), 'head_dim' (one
head's width: q/k norm scales, left replicated by every layout). Mesh layouts map them
to mesh axes (configs/mesh/*.gin, knittrans_jax/mesh.py).

Activations carry logical names too; `constrain` (knittrans_jax/mesh.py) pins them
to the layout's sharding while a train step traces.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx

from knittrans_jax.mesh import constrain
from knittrans_jax.models import blockwise_attention
from knittrans_jax.models.blockwise_attention import RowMask

# The dtype names a model config takes (dtype, param_dtype), the decoder's and the
# vision tower's alike.
DTYPES = ("float32", "bfloat16", "float16", "float64")
_normal = nnx.initializers.normal(stddev=0.02)


def wide(dtype) -> jnp.dtype:
  """The dtype for numerically sensitive math: float32, or float64 under x64 tests."""
  return jnp.promote_types(dtype, jnp.float32)


def dense(rngs: nnx.Rngs, din: int, dout: int, axes: tuple[str, str], dtype,
          bias: bool = False, param_dtype=jnp.float32) -> nnx.Linear:
  return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                    kernel_init=nnx.with_partitioning(_normal, axes),
                    bias_init=nnx.with_partitioning(nnx.initializers.zeros, axes[1:]),
                    rngs=rngs)


class RMSNorm(nnx.Module):
  """Normalises in float32 (as the Hugging Face models do), then scales."""

  def __init__(self, dim: int, eps: float = 1e-6, axis: str = "embed", param_dtype=jnp.float32):
    self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, (axis,))(
        jax.random.key(0), (dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(wide(x.dtype))
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary embedding settings; `llama3` is Llama 3.1's frequency rescaling as
  (factor, low_freq_factor, high_freq_factor, original_max_positions);
  `mrope_section` Qwen2-VL's multimodal split of the frequencies (see `rope`)."""
  theta: float = 10000.0
  llama3: tuple[float, float, float, int] | None = None
  mrope_section: tuple[int, ...] = ()

  def inv_freq(self, head_dim: int) -> np.ndarray:
    # float32 like transformers, so loaded checkpoints match it to rounding.
    inv = (1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.int64)
                                 .astype(np.float32) / head_dim))).astype(np.float32)
    if self.llama3 is None:
      return inv
    factor, low, high, old_len = self.llama3
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
         mrope_section: tuple[int, ...] = ()) -> jax.Array:
  """Rotary position embedding on [B, T, H, D] at integer positions [B, T]; the
  rotated pairs are (i, i + D/2), the Hugging Face (GPT-NeoX) convention.

  M-RoPE (Qwen2-VL): positions [3, B, T] are (temporal, height, width) positions, and
  the D/2 frequencies are cut into consecutive groups of `mrope_section` sizes, group
  i turning with positions[i % 3]. Text tokens have three equal positions, which is
  plain RoPE, so [B, T] positions are accepted with M-RoPE too."""
  dt = wide(x.dtype)
  if positions.ndim == 3:
    if sum(mrope_section) != len(inv_freq):
      raise ValueError(f"rope: positions of shape {positions.shape} need an mrope_section "
                       f"summing to {len(inv_freq)} (head dim / 2), got {mrope_section}")
    which = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)  # [D/2] -> t, h or w
    positions = jnp.moveaxis(positions, 0, -1)[..., which]  # [B, T, D/2]
    angle = positions.astype(dt) * jnp.asarray(inv_freq, dt)
  else:
    angle = positions[..., None].astype(dt) * jnp.asarray(inv_freq, dt)  # [B, T, D/2]
  cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half].astype(dt), x[..., half:].astype(dt)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


ATTENTION_IMPLS = ("einsum", "xla", "cudnn", "auto", "blockwise")


class Attention(nnx.Module):
  """Multi-head attention with grouped-query heads (`kv_heads` <= `heads`), optional
  q/k/v bias and per-head q/k RMSNorm; `mask` [B, Tq, Tk] is True where attending is
  allowed, or a `RowMask` (the causal mask as per-token valid and segment ids: the
  decoder's training forward). `impl` 'einsum' is written out here; 'xla', 'cudnn' and
  'auto' go through jax.nn.dot_product_attention ('auto' lets JAX pick a fused kernel
  on GPU) and take the mask dense, packed segments included; 'blockwise' is
  models/blockwise_attention.py for a RowMask (no [T, T] array: long packed rows) and
  the einsum for a dense mask (the sampler's prefill and decoding)."""

  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs, dtype, rope: Rope | None, *,
               kv_heads: int | None = None, head_dim: int | None = None, qkv_bias: bool = False,
               qk_norm: bool = False, norm_eps: float = 1e-6, impl: str = "einsum",
               block: int = 512, param_dtype=jnp.float32):
    if not head_dim and dim % heads:
      raise ValueError(f"width {dim} is not divisible by {heads} heads")
    head_dim = head_dim or dim // heads
    kv_heads = kv_heads or heads
    if heads % kv_heads:
      raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    if impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention impl {impl!r} is not one of {ATTENTION_IMPLS}")
    self.heads, self.kv_heads, self.head_dim, self.impl = heads, kv_heads, head_dim, impl
    self.block = block  # 'blockwise': tokens per tile
    self.inv_freq = None if rope is None else tuple(rope.inv_freq(head_dim).tolist())
    self.mrope_section = () if rope is None else tuple(rope.mrope_section)
    kw = dict(param_dtype=param_dtype)
    self.q = dense(rngs, dim, heads * head_dim, ("embed", "heads"), dtype, qkv_bias, **kw)
    self.k = dense(rngs, dim, kv_heads * head_dim, ("embed", "heads"), dtype, qkv_bias, **kw)
    self.v = dense(rngs, dim, kv_heads * head_dim, ("embed", "heads"), dtype, qkv_bias, **kw)
    self.o = dense(rngs, heads * head_dim, dim, ("heads", "embed"), dtype, **kw)
    if qk_norm:
      self.q_norm = RMSNorm(head_dim, norm_eps, "head_dim", param_dtype)
      self.k_norm = RMSNorm(head_dim, norm_eps, "head_dim", param_dtype)
    else:
      self.q_norm = self.k_norm = None

  def _qkv(self, x, positions):
    B, T, _ = x.shape
    heads = ("activation_batch", "activation_length", "activation_heads", None)
    q = constrain(self.q(x).reshape(B, T, self.heads, self.head_dim), *heads)
    k = constrain(self.k(x).reshape(B, T, self.kv_heads, self.head_dim), *heads)
    v = constrain(self.v(x).reshape(B, T, self.kv_heads, self.head_dim), *heads)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if self.inv_freq is not None:
      inv = np.asarray(self.inv_freq, np.float32)
      q, k = (rope(q, positions, inv, self.mrope_section),
              rope(k, positions, inv, self.mrope_section))
    return q, k, v

  def _attend(self, q, k, v, mask):
    B, T = q.shape[:2]
    if isinstance(mask, RowMask):
      if self.impl == "blockwise":
        return self.o(blockwise_attention.attention(q, k, v, mask, self.block).reshape(B, T, -1))
      mask = mask.dense()
    if self.impl not in ("einsum", "blockwise"):
      out = jax.nn.dot_product_attention(
          q, k, v, mask=mask[:, None], implementation=None if self.impl == "auto" else self.impl)
      return self.o(out.reshape(B, T, -1))
    dt = wide(q.dtype)
    g = self.heads // self.kv_heads
    if g == 1:  # plain multi-head: 4-d einsums, which XLA's CPU dots run faster
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(dt)
      mask = mask[:, None]
    else:  # query heads grouped over their shared key/value head
      q = q.reshape(B, T, self.kv_heads, g, self.head_dim)
      scores = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(dt)
      mask = mask[:, None, None]
    scores = scores / jnp.sqrt(self.head_dim).astype(dt)
    scores = jnp.where(mask, scores, jnp.finfo(dt).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if g == 1:
      out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    else:
      out = jnp.einsum("bkgts,bskd->btkgd", weights, v)
    return self.o(out.reshape(B, T, -1))

  def __call__(self, x, mask, positions=None, cache=None, index=None):
    """Full attention; with `cache` (k, v of [B, S, kv_heads, D]) the new keys and
    values are written at `index` and the queries attend over the cache (decoding)."""
    q, k, v = self._qkv(x, positions)
    if cache is None:
      return self._attend(q, k, v, mask), (k, v)
    ck = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (0, index, 0, 0))
    cv = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (0, index, 0, 0))
    return self._attend(q, ck, cv, mask), (ck, cv)


class MLP(nnx.Module):
  """SwiGLU feed-forward."""

  def __init__(self, dim: int, hidden: int, rngs: nnx.Rngs, dtype, param_dtype=jnp.float32):
    self.gate = dense(rngs, dim, hidden, ("embed", "mlp"), dtype, param_dtype=param_dtype)
    self.up = dense(rngs, dim, hidden, ("embed", "mlp"), dtype, param_dtype=param_dtype)
    self.down = dense(rngs, hidden, dim, ("mlp", "embed"), dtype, param_dtype=param_dtype)

  def __call__(self, x):
    h = constrain(jax.nn.silu(self.gate(x)) * self.up(x),
                  "activation_batch", "activation_length", "activation_mlp")
    return self.down(h)


class Block(nnx.Module):
  """Pre-norm block; `attn` holds the Attention keyword arguments (GQA, bias, q/k norm)."""

  def __init__(self, dim: int, heads: int, hidden: int, rngs: nnx.Rngs, dtype,
               rope: Rope | None, dropout: float = 0.0, norm_eps: float = 1e-6,
               param_dtype=jnp.float32, **attn):
    self.norm1 = RMSNorm(dim, norm_eps, param_dtype=param_dtype)
    self.norm2 = RMSNorm(dim, norm_eps, param_dtype=param_dtype)
    self.attn = Attention(dim, heads, rngs, dtype, rope, norm_eps=norm_eps,
                          param_dtype=param_dtype, **attn)
    self.mlp = MLP(dim, hidden, rngs, dtype, param_dtype)
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

  def __call__(self, x, mask, positions=None, cache=None, index=None):
    """Returns the block output and this layer's (k, v) (the updated cache if given)."""
    h, kv = self.attn(self.norm1(x), mask, positions, cache, index)
    if self.dropout is not None:
      h = self.dropout(h)
    x = x + h
    out = x + self.mlp(self.norm2(x))
    return constrain(out, "activation_batch", "activation_length", "activation_embed"), kv
