"""Hugging Face checkpoint directories in and out: the one loader and writer every model
family goes through (models/hf.py's decoders, models/qwen_vision_hf.py's tower,
models/qwen_vl.py's both).

    tensors = CheckpointDir(path)
    params = load_params(path, tensors, abs_params, source, present, mesh=mesh, rules=rules,
                         dtype="bfloat16", what="the qwen2 config")

A family says only how one (unscanned) parameter maps onto a stored tensor:
`source(param_path, shape) -> Source(name, stored shape, view)`, where `view` turns the
stored tensor into our layout without reading it (a transpose, a reshape, a slice of
a fused tensor: numpy views of the memory map). Each parameter is created with
`jax.make_array_from_callback` on its NamedSharding, and each device's callback reads
only its own slice's bytes; a scanned stack ([layers, ...], models/scan.py) reads
its slice's layers, each from its own stored tensor. Under jax.distributed each
process is asked only for its own devices' slices. No torch at run time.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from knittrans_jax.mesh import logical_shardings, mesh_or_default
from knittrans_jax.models import scan as layer_scan
from knittrans_jax.models.safetensors_io import SafetensorsFile, write


class CheckpointError(ValueError):
  """A Hugging Face directory a loader cannot map onto its model."""


def read_config(path: str) -> dict[str, Any]:
  fn = os.path.join(path, "config.json")
  if not os.path.exists(fn):
    raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
  with open(fn) as f:
    return json.load(f)


class CheckpointDir:
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


def _same(data):
  return data


@dataclasses.dataclass(frozen=True)
class Source:
  """The stored tensor behind one (unscanned) parameter: its `name`, its `shape` as
  stored, and `view`, stored tensor -> the parameter's layout without reading it."""
  name: str
  shape: tuple[int, ...]
  view: Callable[[np.ndarray], np.ndarray] = _same


def transposed(name: str, shape: tuple[int, ...]) -> Source:
  """A kernel stored as torch's Linear weight: [out, in] for our [in, out]."""
  return Source(name, tuple(shape[::-1]), lambda d: d.T)


def load_params(path: str, tensors: CheckpointDir, abs_params,
                source: Callable[[tuple, tuple[int, ...]], Source], present: set[str], *,
                mesh=None, rules=None, dtype, what: str, desc: str) -> nnx.State:
  """`abs_params` (an abstract nnx.State) filled from the directory's tensors, each
  array on its sharding from the parameters' logical axes and `rules` (default: the
  gin MeshConfig over all devices). `present`: the stored tensors this model owns
  (the others, another part's, are left alone); every one must be used and every
  needed one present. Raises CheckpointError naming the tensor and both shapes, or
  the missing and unexpected tensors against `what` (e.g. 'the qwen2 config')."""
  mesh, rules = mesh_or_default(mesh, rules)
  shardings = dict(nnx.to_flat_state(logical_shardings(nnx.get_partition_spec(abs_params),
                                                       mesh, rules)))

  def sources_of(p, var):
    """One Source, or one per layer of a scanned stack."""
    if not layer_scan.is_stacked(p):
      return [source(p, tuple(var.shape))]
    return [source(("blocks", i) + tuple(p[1:]), tuple(var.shape[1:]))
            for i in range(var.shape[0])]

  flat = [(p, var, sources_of(p, var)) for p, var in nnx.to_flat_state(abs_params)]
  wanted = {s.name for _, _, srcs in flat for s in srcs}
  missing, extra = sorted(wanted - present), sorted(present - wanted)
  if missing:
    raise CheckpointError(f"{path}: missing tensor(s) {missing[:5]}"
                          f"{' ...' if len(missing) > 5 else ''} for {what}")
  if extra:
    raise CheckpointError(f"{path}: unexpected tensor(s) {extra[:5]}"
                          f"{' ...' if len(extra) > 5 else ''} (not in {what} this "
                          "config.json describes)")
  target = jnp.dtype(dtype)
  values = {}
  for p, var, srcs in tqdm(flat, desc=desc, unit="tensor", disable=None):
    views = []
    for s in srcs:
      if tensors.shape(s.name) != s.shape:
        raise CheckpointError(f"{path}: tensor {s.name} has shape {tensors.shape(s.name)}, "
                              f"the config needs {s.shape}")
      views.append(s.view(tensors.tensor(s.name)))
    sharding = shardings[p]
    sharding = sharding.get_value() if hasattr(sharding, "get_value") else sharding
    if not layer_scan.is_stacked(p):
      read = lambda index, v=views[0]: np.asarray(v[index]).astype(target)  # noqa: E731
    else:  # this slice's layers, each read from its own stored tensor
      read = lambda index, vs=views: np.stack(  # noqa: E731
          [np.asarray(vs[i][index[1:]]).astype(target) for i in range(len(vs))[index[0]]])
    values[p] = jax.make_array_from_callback(var.shape, sharding, read)
  flat_state = [(p, v.replace(values[p]) if hasattr(v, "replace") else values[p])
                for p, v in nnx.to_flat_state(abs_params)]
  return nnx.from_flat_state(flat_state)


def host_array(x) -> np.ndarray:
  """A (possibly multi-host) array gathered to this host, for writing a checkpoint."""
  if jax.process_count() > 1 and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def write_checkpoint(path: str, tensors: dict[str, tuple[Any, tuple[int, ...]]],
                     hf_config: dict[str, Any], dtype: str,
                     max_shard_bytes: int = 4 << 30) -> list[str]:
  """Writes `tensors` ({name: (fetch, stored shape)}, e.g. hf.decoder_tensors') as
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
