"""A decoder's weights as one shared-memory segment in Hugging Face layout: the form a
vLLM engine on this host loads a version from (rollout/vllm_weights.py maps it).

One copy: each tensor is written once, under its Hugging Face name, transposed where
the HF layout wants it and cast to the engine's dtype on the way (bf16 halves the
bytes), into a file on /dev/shm (rollout/weight_segment.py's layout, whole tensors).
The engine maps the file and loads from views of it: no pickling, no per-tensor RPC,
no bytes through a socket. The file is the engine's to delete once it has loaded.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from knittrans_jax.rollout.weight_segment import PieceOut, dtype_of, write_segment

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
