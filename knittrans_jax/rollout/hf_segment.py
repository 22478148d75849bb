"""A decoder's weights in the form a vLLM engine on this host loads a version from
(rollout/vllm_weights.py): its Hugging Face tensors as views of shared memory.

- **Views of the published segment** (`hf_views`): when the parameters are views of a
  weight segment this process maps (rollout/weights.py's subscriber, transport
  'shm'), each Hugging Face tensor is described as a strided view of that file
  (transposed, a layer of a scanned stack: strides, not copies), reached by the
  engine's workers as /proc/PID/fd/FD. Nothing is copied here: the trainer's one
  copy into /dev/shm is the only one before vLLM's own load.
- **A segment of its own** (`write_hf_segment`), for parameters that are not such
  views (the 'files' transport, a caller's arrays): each tensor written once under its
  Hugging Face name, transposed where the HF layout wants it and cast to the engine's
  dtype on the way, into a file on /dev/shm (rollout/weight_segment.py's layout, whole
  tensors), which the engine deletes once loaded.
Either way the engine's workers map the file and load from views of it: no pickling,
no per-tensor RPC, no bytes through a socket.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

import numpy as np

from knittrans_jax.rollout.weight_segment import PieceOut, dtype_of, file_of, write_segment

# What a vLLM engine's dtype puts on the way (its own casts on load do the rest).
WIRE_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def wire_dtype(engine_dtype: str) -> str:
  """The segment's dtype for an engine of `engine_dtype` ('auto': float32, as written)."""
  return WIRE_DTYPES.get(engine_dtype, "float32")


def segment_dir() -> str:
  """/dev/shm where there is one (memory, never written back), else the temp dir."""
  return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def write_hf_segment(path: str, params, version: int, dtype: str = "float32") -> int:
  """Writes a DecoderLM's parameters (an nnx.State of host arrays) to `path` as
  whole Hugging Face tensors of `dtype`; returns the bytes of the segment."""
  from knittrans_jax.models.hf import decoder_tensors  # JAX: only on the trainer's side
  dt = dtype_of(dtype)

  def fill(dst, fetch):
    np.copyto(dst, fetch(), casting="unsafe")  # the transpose and the cast, one pass

  pieces = [PieceOut(leaf=i, name=name, box=tuple((0, n) for n in shape), dtype=dt,
                     shape=tuple(shape), fill=lambda dst, fetch=fetch: fill(dst, fetch))
            for i, (name, (fetch, shape)) in enumerate(sorted(decoder_tensors(params).items()))]
  return write_segment(path, version, 0, pieces, checksum=False,
                       full_hint="(the vLLM engines' weights pass through it)")


def hf_views(params) -> list[dict] | None:
  """Every Hugging Face tensor of a DecoderLM's parameters as a view of a segment this
  process maps: [{name, file, offset, dtype, shape, strides (bytes)}]; None if any
  tensor is not wholly inside one (then write_hf_segment)."""
  from knittrans_jax.models.hf import decoder_tensors
  out = []
  for name, (fetch, _) in sorted(decoder_tensors(params).items()):
    a = fetch()
    where = file_of(a) if isinstance(a, np.ndarray) else None
    if where is None:
      return None
    out.append({"name": name, "file": where[0], "offset": where[1], "dtype": a.dtype.name,
                "shape": list(a.shape), "strides": list(a.strides)})
  return out


def push_weights(params, version: int, dtype: str, tag: str,
                 load: Callable[[str, str], dict]) -> tuple[int, dict]:
  """Loads `params` into a vLLM engine through `load(worker method, its string
  argument)` (its collective_rpc): as views of the segment they come from if they do
  (`knittrans_load_views`), else through a segment of their own named after `tag`,
  deleted once loaded (`knittrans_load_segment`). Returns (the bytes the engine reads,
  the worker's report, with `via`: 'views' or 'segment')."""
  plan = hf_views(params)
  if plan is not None:
    nbytes = sum(int(np.prod(e["shape"])) * dtype_of(e["dtype"]).itemsize for e in plan)
    return nbytes, {**load("knittrans_load_views", json.dumps(plan)), "via": "views"}
  path = os.path.join(segment_dir(), f"{tag}-v{version}")
  try:
    nbytes = write_hf_segment(path, params, version, dtype)
    return nbytes, {**load("knittrans_load_segment", path), "via": "segment"}
  finally:
    try:
      os.unlink(path)  # loaded (or failed); a view a worker kept keeps its pages
    except FileNotFoundError:
      pass
