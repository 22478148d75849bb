"""The Qwen2-VL and Qwen2.5-VL vision tower: patch embedding, 2-D rotary blocks,
Qwen2.5-VL's windowed attention, the 2 x 2 patch merger. Its Hugging Face names,
config.json and loading are models/qwen_vision_hf.py's (as the decoder's are
models/hf.py's).

    tower, config = qwen_vision_hf.load("/ckpt/Qwen2.5-VL-7B-Instruct")
    tokens = tower(pixel_values, image_grid_thw)  # [patches / merge^2, out_width]

`pixel_values` [num_patches, C*T*P*P] and `image_grid_thw` [num_images, 3] are what
the image processor emits (models/qwen_image_processor.py or transformers'). The
grid is host data: everything that depends on it (rotary positions, which patches
attend to which, the window permutation) is computed with numpy, so under jit it
is a static argument. The output is in transformers' order: image by image, each
image's merged tokens in raster order over its (h / merge, w / merge) grid.

The whole model (this tower, the decoder with M-RoPE, image embeddings at the
image-pad tokens) is models/qwen_vl.py.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knittrans_jax.models import scan as layer_scan
from knittrans_jax.models.layers import DTYPES, RMSNorm, dense, wide

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("fc", "gated")
# transformers' ACT2FN entries the released vision configs use.
ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
  """The vision tower of either family; defaults are Qwen2.5-VL-7B's.

  Hugging Face names (vision_config): `width` is embed_dim (Qwen2-VL) or hidden_size
  (Qwen2.5-VL); `out_width` is hidden_size (Qwen2-VL) or out_hidden_size (Qwen2.5-VL),
  the language model's width; `mlp_width` is embed_dim * mlp_ratio or
  intermediate_size; `merge` is spatial_merge_size; `full_attention_layers` is
  fullatt_block_indexes. `window_size` (pixels) 0 means every layer attends over its
  whole frame (Qwen2-VL); otherwise layers not in `full_attention_layers` attend
  within windows of window_size / patch_size patches a side.
  """
  family: str = "qwen2_5_vl"
  depth: int = 32
  width: int = 1280
  heads: int = 16
  mlp_width: int = 3420
  out_width: int = 3584
  patch_size: int = 14
  temporal_patch_size: int = 2
  merge: int = 2
  channels: int = 3
  act: str = "silu"
  norm: str = "rmsnorm"   # Qwen2-VL: 'layernorm' (with bias)
  mlp: str = "gated"      # Qwen2-VL: 'fc' (fc1, act, fc2); Qwen2.5-VL: gate/up/down
  window_size: int = 112
  full_attention_layers: tuple[int, ...] = (7, 15, 23, 31)
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  dtype: str = "float32"
  param_dtype: str = "float32"
  scan_layers: bool = False  # the blocks as one lax.scan stack (models/scan.py)

  def __post_init__(self):
    object.__setattr__(self, "full_attention_layers", tuple(self.full_attention_layers))
    for name in ("depth", "width", "heads", "mlp_width", "out_width", "patch_size",
                 "temporal_patch_size", "merge", "channels"):
      if getattr(self, name) <= 0:
        raise ValueError(f"QwenVisionConfig.{name} = {getattr(self, name)} must be positive")
    for name, allowed in (("family", FAMILIES), ("norm", NORMS), ("mlp", MLPS),
                          ("act", tuple(ACTIVATIONS)), ("dtype", DTYPES),
                          ("param_dtype", DTYPES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"QwenVisionConfig.{name} = {getattr(self, name)!r} is not one of "
                         f"{allowed}")
    if self.width % self.heads or (self.width // self.heads) % 4:
      # The 2-D rotary embedding gives a quarter of each head to rows, a quarter to columns.
      raise ValueError(f"QwenVisionConfig: width {self.width} / heads {self.heads} must be a "
                       "whole head dim divisible by 4")
    if self.window_size < 0 or (self.window_size and self.window_units == 0):
      raise ValueError(f"QwenVisionConfig.window_size = {self.window_size} must be 0 (no "
                       f"windows) or at least patch_size * merge = {self.patch_size * self.merge}")
    bad = [i for i in self.full_attention_layers if not 0 <= i < self.depth]
    if bad:
      raise ValueError(f"QwenVisionConfig.full_attention_layers {bad} are not layers of a "
                       f"depth-{self.depth} tower")

  @property
  def head_dim(self) -> int:
    return self.width // self.heads

  @property
  def patch_dim(self) -> int:
    """One row of pixel_values: C * T * P * P."""
    return self.channels * self.temporal_patch_size * self.patch_size ** 2

  @property
  def window_units(self) -> int:
    """A window's side in merged tokens (transformers' vit_merger_window_size)."""
    return self.window_size // self.merge // self.patch_size


# -- host-side bookkeeping for one image_grid_thw ---------------------------------
@dataclasses.dataclass(frozen=True)
class PatchLayout:
  """Where each patch goes, in the order the blocks see the patches (numpy).

  order: [units] the merge units (merge x merge patches, consecutive in
    pixel_values) in window order; the identity without windows.
  positions: [patches, 2] each patch's (row, column) in its image's patch grid.
  frames: [patches] one id per frame (a frame attends only to itself).
  windows: [patches] one id per window (for the windowed layers).
  """
  order: np.ndarray
  positions: np.ndarray
  frames: np.ndarray
  windows: np.ndarray

  @property
  def inverse(self) -> np.ndarray:
    return np.argsort(self.order)


def check_grid(config: QwenVisionConfig, image_grid_thw) -> np.ndarray:
  """image_grid_thw as an int64 numpy [n, 3], or a ValueError naming what is wrong."""
  try:
    grid = np.asarray(image_grid_thw)
  except jax.errors.TracerArrayConversionError:
    raise ValueError("image_grid_thw must be concrete host ints (numpy or a tuple): the "
                     "attention pattern depends on it; make it a static argument under jit"
                     ) from None
  if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or \
      not np.issubdtype(grid.dtype, np.integer):
    raise ValueError(f"image_grid_thw has shape {grid.shape} and dtype {grid.dtype}; it must "
                     "be integer (num_images, 3) rows of (t, h, w)")
  m = config.merge
  for i, (t, h, w) in enumerate(grid.tolist()):
    if t < 1 or h < m or w < m or h % m or w % m:
      raise ValueError(f"image_grid_thw[{i}] = {(t, h, w)}: t must be >= 1 and h, w "
                       f"positive multiples of merge = {m}")
  return grid.astype(np.int64)


def patch_layout(config: QwenVisionConfig, image_grid_thw) -> PatchLayout:
  """The layout transformers uses (get_vision_position_ids, get_vision_window_index),
  as segment ids rather than cumulative lengths."""
  grid = check_grid(config, image_grid_thw)
  m, u, ws = config.merge, config.merge ** 2, config.window_units
  keys, positions, frames = [], [], []
  frame = 0
  for image, (t, h, w) in enumerate(grid.tolist()):
    # The processor lays each frame out block by block: merge blocks in raster order,
    # the merge x merge patches of a block consecutive.
    bh, bw = np.meshgrid(np.arange(h // m), np.arange(w // m), indexing="ij")
    ih, iw = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    rows = (bh[:, :, None, None] * m + ih).reshape(-1)
    cols = (bw[:, :, None, None] * m + iw).reshape(-1)
    positions.append(np.tile(np.stack([rows, cols], -1), (t, 1)))
    frames.append(np.repeat(np.arange(frame, frame + t), h * w))
    frame += t
    # A unit's window: (image, frame, window row, window column), then raster inside.
    tt, bh, bw = (a.reshape(-1) for a in np.meshgrid(
        np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij"))
    wh, ww = (bh // ws, bw // ws) if ws else (0 * bh, 0 * bw)
    keys.append(np.stack([np.full_like(tt, image), tt, wh, ww, bh, bw], -1))
  keys = np.concatenate(keys)
  frames = np.concatenate(frames)
  if config.window_size:
    order = np.lexsort(keys.T[::-1])  # sorts by image, frame, window, then position
    win = keys[order, :4]
    starts = np.r_[True, np.any(win[1:] != win[:-1], axis=1)]
    windows = np.repeat(np.cumsum(starts) - 1, u)
  else:
    order = np.arange(len(keys))
    windows = frames
  patch_order = (order[:, None] * u + np.arange(u)).reshape(-1)
  return PatchLayout(order=order, positions=np.concatenate(positions)[patch_order],
                     frames=frames[patch_order], windows=windows)


# -- layers --------------------------------------------------------------------------
class LayerNorm(nnx.Module):
  """LayerNorm with bias, normalising in float32 (or wider) like torch's on float32."""

  def __init__(self, dim: int, eps: float = 1e-6, axis: str = "embed", param_dtype=jnp.float32):
    self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, (axis,))(
        jax.random.key(0), (dim,), param_dtype))
    self.bias = nnx.Param(nnx.with_partitioning(nnx.initializers.zeros, (axis,))(
        jax.random.key(0), (dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(wide(x.dtype))
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


def _norm(config: QwenVisionConfig, dim: int, pdt):
  if config.norm == "layernorm":
    return LayerNorm(dim, config.norm_eps, param_dtype=pdt)
  return RMSNorm(dim, config.norm_eps, param_dtype=pdt)


def rotate(x, cos, sin):
  """Rotary embedding on [N, H, D] with per-patch angles' cos/sin [N, D/2]; the pairs
  are (i, i + D/2) as in every Hugging Face model."""
  dt = wide(x.dtype)
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half].astype(dt), x[..., half:].astype(dt)
  cos, sin = cos[:, None, :], sin[:, None, :]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rotary_angles(config: QwenVisionConfig, positions: np.ndarray) -> np.ndarray:
  """[N, head_dim / 2] float32 angles: the first half of the rotated pairs turn with
  the patch's row, the second half with its column, at the same frequencies."""
  quarter = config.head_dim // 4
  exponent = np.arange(quarter, dtype=np.float32) * 2 / np.float32(config.head_dim // 2)
  inv_freq = (1.0 / np.float32(config.rope_theta) ** exponent).astype(np.float32)
  pos = positions.astype(np.float32)
  return np.concatenate([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], axis=-1)


class VisionAttention(nnx.Module):
  """Bidirectional attention restricted to a segment (a frame or a window) per patch.
  The checkpoint's fused qkv is split into q, k and v so each shards over 'heads'."""

  def __init__(self, config: QwenVisionConfig, rngs: nnx.Rngs):
    d, dt, pdt = config.width, jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    self.heads, self.head_dim = config.heads, config.head_dim
    self.q = dense(rngs, d, d, ("embed", "heads"), dt, True, pdt)
    self.k = dense(rngs, d, d, ("embed", "heads"), dt, True, pdt)
    self.v = dense(rngs, d, d, ("embed", "heads"), dt, True, pdt)
    self.o = dense(rngs, d, d, ("heads", "embed"), dt, True, pdt)

  def __call__(self, x, segments: "Segments", cos, sin):
    N = x.shape[0]
    q = rotate(self.q(x).reshape(N, self.heads, self.head_dim), cos, sin)
    k = rotate(self.k(x).reshape(N, self.heads, self.head_dim), cos, sin)
    v = self.v(x).reshape(N, self.heads, self.head_dim)
    dt = wide(q.dtype)
    # Segment by segment (transformers' loop over cu_seqlens, or flash-attention varlen):
    # each segment's patches gathered into a row of [S, L], shorter ones padded and
    # masked, so the cost is S * L^2, not the square of the whole pack's patches.
    idx, valid = jnp.asarray(segments.index), jnp.asarray(segments.valid)
    qs, ks, vs = q[idx], k[idx], v[idx]  # [S, L, heads, head_dim]
    scores = jnp.einsum("sqhd,skhd->shqk", qs, ks).astype(dt) / jnp.sqrt(self.head_dim).astype(dt)
    scores = jnp.where(valid[:, None, None, :], scores, jnp.finfo(dt).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(vs.dtype)
    out = jnp.einsum("shqk,skhd->sqhd", weights, vs).reshape(-1, self.heads, self.head_dim)
    # Segments are contiguous runs in patch order: the valid slots, row by row, are
    # the patches 0..N-1 in order.
    return self.o(out[segments.flat].reshape(N, -1))


@dataclasses.dataclass(frozen=True)
class Segments:
  """Host-side gather plan of contiguous attention segments (frames or windows):
  index [S, L] the patches of segment s (padded with 0), valid [S, L], and flat, the
  positions of the valid slots in the flattened [S * L]."""
  index: np.ndarray
  valid: np.ndarray
  flat: np.ndarray

  @classmethod
  def of(cls, ids: np.ndarray) -> "Segments":
    ids = np.asarray(ids)
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    ends = np.r_[starts[1:], len(ids)]
    if len(np.unique(ids)) != len(starts):
      raise ValueError("attention segments must be contiguous runs of patches")
    index = starts[:, None] + np.arange(int(np.max(ends - starts)))[None]
    valid = index < ends[:, None]
    return cls(np.where(valid, index, 0).astype(np.int32), valid,
               np.flatnonzero(valid.reshape(-1)).astype(np.int32))


class VisionMLP(nnx.Module):
  """Qwen2-VL's fc1 -> act -> fc2, or Qwen2.5-VL's gated down(act(gate) * up), with biases."""

  def __init__(self, config: QwenVisionConfig, rngs: nnx.Rngs):
    d, h = config.width, config.mlp_width
    dt, pdt = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    self.act = ACTIVATIONS[config.act]
    self.gated = config.mlp == "gated"
    if self.gated:
      self.gate = dense(rngs, d, h, ("embed", "mlp"), dt, True, pdt)
      self.up = dense(rngs, d, h, ("embed", "mlp"), dt, True, pdt)
      self.down = dense(rngs, h, d, ("mlp", "embed"), dt, True, pdt)
    else:
      self.fc1 = dense(rngs, d, h, ("embed", "mlp"), dt, True, pdt)
      self.fc2 = dense(rngs, h, d, ("mlp", "embed"), dt, True, pdt)

  def __call__(self, x):
    if self.gated:
      return self.down(self.act(self.gate(x)) * self.up(x))
    return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nnx.Module):
  def __init__(self, config: QwenVisionConfig, rngs: nnx.Rngs):
    pdt = jnp.dtype(config.param_dtype)
    self.norm1 = _norm(config, config.width, pdt)
    self.norm2 = _norm(config, config.width, pdt)
    self.attn = VisionAttention(config, rngs)
    self.mlp = VisionMLP(config, rngs)

  def __call__(self, x, segments, cos, sin):
    x = x + self.attn(self.norm1(x), segments, cos, sin)
    return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
  """Norm each patch, concatenate each merge x merge block (consecutive patches), then
  two layers with exact GELU up to the language model's width."""

  def __init__(self, config: QwenVisionConfig, rngs: nnx.Rngs):
    dt, pdt = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    cat = config.width * config.merge ** 2
    self.norm = _norm(config, config.width, pdt)
    self.fc1 = dense(rngs, cat, cat, (None, "mlp"), dt, True, pdt)
    self.fc2 = dense(rngs, cat, config.out_width, ("mlp", "embed"), dt, True, pdt)
    self.cat = cat

  def __call__(self, x):
    x = self.norm(x).reshape(-1, self.cat)
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class QwenVisionTower(nnx.Module):
  """pixel_values [patches, C*T*P*P], image_grid_thw [images, 3] (host ints) ->
  merged image tokens [patches / merge^2, out_width], in transformers' order."""

  def __init__(self, config: QwenVisionConfig, rngs: nnx.Rngs):
    self.config = config
    dt, pdt = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    # The checkpoint's Conv3d has stride = kernel, so it is one matmul per patch.
    self.patch = dense(rngs, config.patch_dim, config.width, ("patch", "embed"), dt,
                       param_dtype=pdt)
    self.blocks = (layer_scan.stack(lambda r: VisionBlock(config, r), config.depth, rngs)
                   if config.scan_layers else
                   nnx.List([VisionBlock(config, rngs) for _ in range(config.depth)]))
    self.merger = PatchMerger(config, rngs)

  def __call__(self, pixel_values, image_grid_thw):
    cfg = self.config
    grid = check_grid(cfg, image_grid_thw)
    want = (int(np.sum(np.prod(grid, axis=1))), cfg.patch_dim)
    if tuple(pixel_values.shape) != want:
      raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; image_grid_thw "
                       f"{grid.tolist()} needs {want} (sum of t*h*w patches, C*T*P*P = "
                       f"{cfg.channels}*{cfg.temporal_patch_size}*{cfg.patch_size}*"
                       f"{cfg.patch_size})")
    layout = patch_layout(cfg, grid)
    u = cfg.merge ** 2
    x = self.patch(jnp.asarray(pixel_values, cfg.dtype))
    windowed = bool(cfg.window_size)
    if windowed:
      x = x.reshape(-1, u, cfg.width)[layout.order].reshape(-1, cfg.width)
    angles = jnp.asarray(rotary_angles(cfg, layout.positions))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    frames = Segments.of(layout.frames)
    windows = Segments.of(layout.windows) if windowed else frames
    full = [not windowed or i in cfg.full_attention_layers for i in range(cfg.depth)]
    if cfg.scan_layers:
      def layer(block, h, full_here):
        if all(full) or not any(full):
          return block(h, frames if full[0] else windows, cos, sin), None
        # Qwen2.5-VL: a few full-attention layers among windowed ones, one branch each.
        return jax.lax.cond(full_here, lambda: block(h, frames, cos, sin),
                            lambda: block(h, windows, cos, sin)), None
      x, _ = layer_scan.scan(self.blocks, layer, x, jnp.asarray(full))
    else:
      for block, full_here in zip(self.blocks, full):
        x = block(x, frames if full_here else windows, cos, sin)
    out = self.merger(x)
    return out[layout.inverse] if windowed else out
