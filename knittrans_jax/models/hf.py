"""Hugging Face checkpoints in and out: Qwen2/2.5, Qwen3 and Llama 3 decoders.

    model, config = hf.load("/ckpt/Qwen2.5-0.5B", dtype="bfloat16", mesh=mesh, rules=rules)
    hf.save(model, config, "/out/step_100")

`load` never holds the whole model on one device: each parameter is created with
`jax.make_array_from_callback` on its NamedSharding (from the model's logical axes
and the layout's rules), and the callback reads only the slice a device holds from
the memory-mapped safetensors file. Under jax.distributed each process is asked only
for its own devices' slices. No torch at run time.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from knittrans_jax.models import scan as layer_scan
from knittrans_jax.models.decoder import DecoderConfig, DecoderLM
from knittrans_jax.models.safetensors_io import SafetensorsFile, write
from knittrans_jax.train.mesh import MeshConfig, logical_shardings, make_mesh

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "llama": "LlamaForCausalLM"}
# Tensors some exporters write that are derived, not parameters.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
  """A Hugging Face directory this loader cannot map onto DecoderLM."""


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
class _Tensors:
  """name -> SafetensorsFile over a directory (one file or a sharded index)."""

  def __init__(self, path: str):
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):  # as transformers does: the single file first
      st = SafetensorsFile(single)
      self._where = {n: st for n in st.names}
    elif os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = {fn: SafetensorsFile(os.path.join(path, fn)) for fn in sorted(set(weight_map.values()))}
      self._where = {}
      for name, fn in weight_map.items():
        if name not in files[fn].names:
          raise CheckpointError(f"{fn}: tensor {name} listed in the index is not in the file")
        self._where[name] = files[fn]
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
      if not files:
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
      self._where = {}
      for fn in files:
        st = SafetensorsFile(os.path.join(path, fn))
        self._where.update({n: st for n in st.names})

  @property
  def names(self) -> set[str]:
    return set(self._where)

  def shape(self, name):
    return self._where[name].shape(name)

  def tensor(self, name):
    return self._where[name].tensor(name)


def read_config(path: str) -> dict[str, Any]:
  fn = os.path.join(path, "config.json")
  if not os.path.exists(fn):
    raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
  with open(fn) as f:
    return json.load(f)


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
  if mesh is None:
    mc = MeshConfig()
    mesh, rules = make_mesh(mc), (mc.rules if rules is None else rules)
  tensors = _Tensors(path)
  graphdef, abs_params, rest = nnx.split(abstract_model(config), nnx.Param, ...)
  shardings = logical_shardings(nnx.get_partition_spec(abs_params), mesh, rules or ())

  def name_of(p):
    name, transposed = hf_name(p)
    return (prefix + name.removeprefix("model.") if name.startswith("model.") else name,
            transposed)

  def layers_of(p, var):
    """The checkpoint tensors (name, transposed, one layer's shape) making up `var`: one,
    or one per layer of a scanned stack."""
    if not layer_scan.is_stacked(p):
      return [(*name_of(p), tuple(var.shape))]
    return [(*name_of(("blocks", i) + tuple(p[1:])), tuple(var.shape[1:]))
            for i in range(var.shape[0])]

  flat = [(p, var, layers_of(p, var)) for p, var in nnx.to_flat_state(abs_params)]
  wanted = {name for _, _, parts in flat for name, _, _ in parts}
  present = {n for n in tensors.names if not _IGNORED.match(n) and (owns is None or owns(n))}
  if config.tie_embeddings:  # some exporters write the tied head too; it is the embedding
    present.discard("lm_head.weight")
  missing = sorted(set(wanted) - present)
  extra = sorted(present - set(wanted))
  if missing:
    raise CheckpointError(f"{path}: missing tensor(s) {missing[:5]}"
                          f"{' ...' if len(missing) > 5 else ''} for {config.family} config")
  if extra:
    raise CheckpointError(f"{path}: unexpected tensor(s) {extra[:5]}"
                          f"{' ...' if len(extra) > 5 else ''} (not in the {config.family} "
                          f"architecture this config.json describes)")
  sh_flat = dict(nnx.to_flat_state(shardings))
  target = jnp.dtype(config.param_dtype)
  values = {}
  for p, var, parts in tqdm(flat, desc=f"loading {os.path.basename(path.rstrip('/'))}",
                            unit="tensor", disable=None):
    datas = []
    for name, transposed, shape in parts:
      src = tensors.shape(name)
      want = shape[::-1] if transposed else shape
      if src != want:
        raise CheckpointError(f"{path}: tensor {name} has shape {src}, the config needs {want}")
      datas.append((tensors.tensor(name), transposed))
    sharding = sh_flat[p]
    sharding = sharding.get_value() if hasattr(sharding, "get_value") else sharding

    def read_one(index, data, transposed):
      part = data[tuple(reversed(index))].T if transposed else data[index]
      return np.asarray(part).astype(target)  # reads only this slice's bytes

    if not layer_scan.is_stacked(p):
      read = lambda index, d=datas[0]: read_one(index, *d)  # noqa: E731
    else:  # a scanned stack: this slice's layers, each read as one unscanned layer
      read = lambda index, ds=datas: np.stack(  # noqa: E731
          [read_one(index[1:], *ds[i]) for i in range(len(ds))[index[0]]])
    values[p] = jax.make_array_from_callback(var.shape, sharding, read)
  return nnx.merge(graphdef, _fill(abs_params, values), rest)


def _fill(abs_params, values):
  """abs_params with each Variable's value replaced by the loaded array."""
  flat = [(p, v.replace(values[p]) if hasattr(v, "replace") else values[p])
          for p, v in nnx.to_flat_state(abs_params)]
  return nnx.from_flat_state(flat)


# -- saving ------------------------------------------------------------------------
def _host(x) -> np.ndarray:
  if jax.process_count() > 1 and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


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
    out[name] = ((lambda get=get, tr=tr: _host(get()).T if tr else _host(get())),
                 shape[::-1] if tr else shape)
  return out


def write_checkpoint(path: str, tensors: dict[str, tuple[Any, tuple[int, ...]]],
                     hf_config: dict[str, Any], dtype: str,
                     max_shard_bytes: int = 4 << 30) -> list[str]:
  """Writes `tensors` ({name: (fetch, stored shape)}, e.g. decoder_tensors') as
  model*.safetensors in `dtype`, with `hf_config` as config.json; every process
  fetches (a multi-host gather), process 0 writes. Returns the files written."""
  hf = hf_config
  np_dtype = np.dtype(jnp.dtype(dtype))
  specs = [(name, shape, np_dtype) for name, (_, shape) in sorted(tensors.items())]
  shards, cur, size = [], [], 0
  for spec in specs:
    nbytes = int(np.prod(spec[1])) * np_dtype.itemsize
    if cur and size + nbytes > max_shard_bytes:
      shards.append(cur)
      cur, size = [], 0
    cur.append(spec)
    size += nbytes
  shards.append(cur)

  def fetch(name):
    return tensors[name][0]()  # every process takes part in a multi-host gather

  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
    # A previous save's shards or index would be read instead of (or mixed with) these.
    for old in os.listdir(path):
      if old.startswith("model") and (old.endswith(".safetensors") or
                                      old == "model.safetensors.index.json"):
        os.remove(os.path.join(path, old))
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  for fn, shard in zip(names, tqdm(shards, desc="saving", unit="shard", disable=None)):
    out = os.path.join(path, fn) if writer else os.devnull
    if writer:
      write(out, shard, fetch, metadata={"format": "pt"})
    else:
      for name, _, _ in shard:
        fetch(name)
  if writer:
    if len(shards) > 1:
      index = {"metadata": {"total_size": sum(int(np.prod(s)) * np_dtype.itemsize
                                              for _, s, _ in specs)},
               "weight_map": {n: fn for fn, shard in zip(names, shards) for n, _, _ in shard}}
      with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(hf, f, indent=2)
  return [os.path.join(path, n) for n in names]
