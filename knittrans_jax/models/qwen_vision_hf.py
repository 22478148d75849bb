"""Hugging Face names and loading for the Qwen2-VL / Qwen2.5-VL vision tower
(models/qwen_vision.py): its config from config.json's vision_config, our parameter
paths onto the checkpoint's `visual.*` tensors (q, k and v as views of the fused
qkv), and back for export. Reading and writing are models/checkpoint_io.py's.

    tower, config = qwen_vision_hf.load("/ckpt/Qwen2.5-VL-7B-Instruct")
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
from flax import nnx

# The decoder loader's directory reader (single file, sharded index) and helpers.
from knittrans_jax.models import scan as layer_scan
from knittrans_jax.models.checkpoint_io import (CheckpointDir, CheckpointError, Source,
                                                host_array, load_params, read_config)
from knittrans_jax.models.qwen_vision import FAMILIES, QwenVisionConfig, QwenVisionTower


# transformers' Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig defaults, for keys a
# config.json leaves out (released Qwen2-VL configs have no hidden_act, for one).
_HF_DEFAULTS = {
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu",
                     mlp_ratio=4, num_heads=16, in_channels=3, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420,
                       num_heads=16, in_channels=3, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                       fullatt_block_indexes=(7, 15, 23, 31)),
}


def config_from_hf(hf: dict[str, Any], **overrides) -> QwenVisionConfig:
  """The vision tower's config from a Qwen2-VL / Qwen2.5-VL config.json dict (or its
  vision_config alone); `overrides` (dtype, param_dtype, ...) win."""
  vc = hf.get("vision_config", hf)
  family = None
  for mt in (hf.get("model_type"), vc.get("model_type")):
    mt = (mt or "").removesuffix("_vision")
    if mt in FAMILIES:
      family = mt
      break
  if family is None:
    raise CheckpointError(f"config.json: model_type={hf.get('model_type')!r} (vision_config "
                          f"model_type={vc.get('model_type')!r}) is not one of {FAMILIES}")
  v = {**_HF_DEFAULTS[family], **vc}
  if "in_chans" in vc and "in_channels" not in vc:  # the released configs' older name
    v["in_channels"] = vc["in_chans"]
  rp = v.get("rope_parameters") or {}
  kw = dict(family=family, depth=int(v["depth"]), heads=int(v["num_heads"]),
            patch_size=int(v["patch_size"]), temporal_patch_size=int(v["temporal_patch_size"]),
            merge=int(v["spatial_merge_size"]), channels=int(v["in_channels"]),
            act=v["hidden_act"], rope_theta=float(rp.get("rope_theta", v.get("rope_theta", 1e4))))
  if family == "qwen2_vl":
    kw.update(width=int(v["embed_dim"]), mlp_width=int(v["embed_dim"] * v["mlp_ratio"]),
              out_width=int(v["hidden_size"]), norm="layernorm", mlp="fc", window_size=0,
              full_attention_layers=())
  else:
    kw.update(width=int(v["hidden_size"]), mlp_width=int(v["intermediate_size"]),
              out_width=int(v["out_hidden_size"]), norm="rmsnorm", mlp="gated",
              window_size=int(v["window_size"]),
              full_attention_layers=tuple(int(i) for i in v["fullatt_block_indexes"]))
  kw.update(overrides)
  try:
    return QwenVisionConfig(**kw)
  except ValueError as e:
    raise CheckpointError(f"config.json vision_config: {e}") from None


# Our parameter path -> (tensor name under the visual prefix, how it is stored):
# 'T' transposed (torch Linear), 'conv' the Conv3d kernel, 'qkv0/1/2' rows of the fused qkv.
_BLOCK = {("attn", "o", "kernel"): ("attn.proj.weight", "T"),
          ("attn", "o", "bias"): ("attn.proj.bias", None)}
for _i, _p in enumerate("qkv"):
  _BLOCK[("attn", _p, "kernel")] = ("attn.qkv.weight", f"qkv{_i}")
  _BLOCK[("attn", _p, "bias")] = ("attn.qkv.bias", f"qkv{_i}")
for _n in ("norm1", "norm2"):
  _BLOCK[(_n, "scale")] = (f"{_n}.weight", None)
  _BLOCK[(_n, "bias")] = (f"{_n}.bias", None)
for _ours, _theirs in (("fc1", "fc1"), ("fc2", "fc2"), ("gate", "gate_proj"), ("up", "up_proj"),
                       ("down", "down_proj")):
  _BLOCK[("mlp", _ours, "kernel")] = (f"mlp.{_theirs}.weight", "T")
  _BLOCK[("mlp", _ours, "bias")] = (f"mlp.{_theirs}.bias", None)
_TOP = {("patch", "kernel"): ("patch_embed.proj.weight", "conv"),
        ("merger", "norm", "scale"): ("merger.ln_q.weight", None),
        ("merger", "norm", "bias"): ("merger.ln_q.bias", None),
        ("merger", "fc1", "kernel"): ("merger.mlp.0.weight", "T"),
        ("merger", "fc1", "bias"): ("merger.mlp.0.bias", None),
        ("merger", "fc2", "kernel"): ("merger.mlp.2.weight", "T"),
        ("merger", "fc2", "bias"): ("merger.mlp.2.bias", None)}
# transformers 5 writes the original `visual.`; its in-memory module is `model.visual.`.
PREFIXES = ("visual.", "model.visual.")


def hf_source(path: tuple) -> tuple[str, str | None]:
  """Our parameter path -> (tensor name without the prefix, how it is stored)."""
  path = tuple(p.key if hasattr(p, "key") else getattr(p, "idx", p) for p in path)
  if path[0] == "blocks":
    name, how = _BLOCK[tuple(path[2:])]
    return f"blocks.{int(path[1])}.{name}", how
  return _TOP[path]


def _stored_shape(config: QwenVisionConfig, shape: tuple[int, ...], how) -> tuple[int, ...]:
  """The checkpoint tensor's shape for one of our parameters of `shape`."""
  if how == "T":
    return shape[::-1]
  if how == "conv":
    c = config
    return (c.width, c.channels, c.temporal_patch_size, c.patch_size, c.patch_size)
  if how and how.startswith("qkv"):
    return (3 * shape[-1],) + shape[:-1][::-1]
  return shape


def _view(how):
  """Stored tensor -> our layout, as a view (nothing read until a device's slice is)."""
  if how == "T":
    return lambda d: d.T
  if how == "conv":  # Conv3d [width, C, T, P, P] -> [C*T*P*P, width]
    return lambda d: d.reshape(d.shape[0], -1).T
  if how and how.startswith("qkv"):  # one third of the fused qkv
    k = int(how[3])

    def third(d):
      n = d.shape[0] // 3
      part = d[k * n:(k + 1) * n]
      return part.T if part.ndim == 2 else part
    return third
  return lambda d: d


def hf_tensors(params, config: QwenVisionConfig, prefix: str = "visual."
               ) -> dict[str, tuple[Any, tuple[int, ...]]]:
  """The tower's parameters (an nnx.State) as checkpoint tensors, the inverse of `load`:
  {name: (fetch() -> the host tensor as stored, its stored shape)} (checkpoint_io.write_checkpoint);
  q, k and v go back into one fused qkv."""
  parts: dict[str, dict] = {}
  for p, shape, get in layer_scan.layer_entries(params):  # a scanned stack layer by layer
    name, how = hf_source(p)
    parts.setdefault(prefix + name, {})[how] = (get, shape)
  out = {}
  for name, got in parts.items():
    if set(got) == {"qkv0", "qkv1", "qkv2"}:
      qkv = [got[f"qkv{i}"][0] for i in range(3)]
      out[name] = ((lambda qkv=qkv: np.concatenate([host_array(get()).T for get in qkv])),
                   _stored_shape(config, got["qkv0"][1], "qkv0"))
      continue
    ((how, (get, shape)),) = got.items()
    shape = _stored_shape(config, shape, how)
    if how == "T":
      fetch = lambda get=get: host_array(get()).T  # noqa: E731
    elif how == "conv":  # [C*T*P*P, width] -> Conv3d [width, C, T, P, P]
      fetch = lambda get=get, shape=shape: host_array(get()).T.reshape(shape)  # noqa: E731
    else:
      fetch = lambda get=get: host_array(get())  # noqa: E731
    out[name] = (fetch, shape)
  return out


def abstract_tower(config: QwenVisionConfig):
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: QwenVisionTower(config, nnx.Rngs(0)))


def load(path: str, dtype: str = "float32", *, mesh=None, rules=None,
         **overrides) -> tuple[QwenVisionTower, QwenVisionConfig]:
  """Loads the vision tower of a Qwen2-VL / Qwen2.5-VL directory onto the mesh.

  Reads config.json's vision_config and the `visual.*` (or `model.visual.*`) tensors;
  the language model's tensors are left alone. `dtype` sets parameters and
  activations (pass `param_dtype` in `overrides` to keep parameters wider).
  `mesh`/`rules` default to the gin MeshConfig over all devices. Raises
  CheckpointError naming the tensor and both shapes on a mismatch, and any missing
  or unexpected visual tensor."""
  overrides = {"dtype": dtype, "param_dtype": dtype, **overrides}
  config = config_from_hf(read_config(path), **overrides)
  tensors = CheckpointDir(path)
  prefix = next((p for p in PREFIXES if any(n.startswith(p) for n in tensors.names)), None)
  if prefix is None:
    raise CheckpointError(f"{path}: no vision tensors (none named {' or '.join(PREFIXES)}*)")
  graphdef, abs_params, rest = nnx.split(abstract_tower(config), nnx.Param, ...)

  def source(p, shape):
    name, how = hf_source(p)
    return Source(prefix + name, _stored_shape(config, shape, how), _view(how))

  params = load_params(path, tensors, abs_params, source,
                       {n for n in tensors.names if n.startswith(prefix)}, mesh=mesh,
                       rules=rules, dtype=config.param_dtype,
                       what=f"the {config.family} vision tower",
                       desc=f"loading {os.path.basename(path.rstrip('/'))} vision")
  return nnx.merge(graphdef, params, rest), config
