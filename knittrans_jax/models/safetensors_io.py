"""Lazy reading and streaming writing of .safetensors files, without torch.

The `safetensors` package's numpy reader cannot return bfloat16 (it raises
"data type 'bfloat16' not understood"), and real checkpoints are bfloat16. The format
is simple: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw bytes. Here a file is memory-mapped and each tensor is a
numpy view (bfloat16 through ml_dtypes), so a slice reads only its own bytes.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
  pass


class SafetensorsFile:
  """One .safetensors file: `names`, `shape(name)`, `tensor(name)` (a lazy memmap view)."""

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) < 8:
        raise SafetensorsError(f"{path}: truncated shard ({size} bytes, no header)")
      (n,) = struct.unpack("<Q", raw)
      if 8 + n > size:
        raise SafetensorsError(f"{path}: truncated shard (header of {n} bytes, file of {size})")
      try:
        header = json.loads(f.read(n))
      except json.JSONDecodeError as e:
        raise SafetensorsError(f"{path}: header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    self._base = 8 + n
    self._entries = header
    end = max((e["data_offsets"][1] for e in header.values()), default=0)
    if self._base + end > size:
      raise SafetensorsError(f"{path}: truncated shard: tensors need {self._base + end} bytes, "
                             f"the file has {size}")
    for name, e in header.items():
      if e["dtype"] not in _DTYPES:
        raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
    self._map = np.memmap(path, np.uint8, "r") if size else None

  @property
  def names(self) -> list[str]:
    return list(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entries[name]["shape"])

  def dtype(self, name: str) -> np.dtype:
    return _DTYPES[self._entries[name]["dtype"]]

  def tensor(self, name: str) -> np.ndarray:
    e = self._entries[name]
    lo, hi = e["data_offsets"]
    dt = _DTYPES[e["dtype"]]
    return self._map[self._base + lo:self._base + hi].view(dt).reshape(e["shape"])


def write(path: str, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]], fetch,
          metadata: dict[str, str] | None = None) -> None:
  """Writes tensors one at a time: `tensors` gives (name, shape, dtype) up front (the
  header), `fetch(name)` returns each array when its turn comes, so the host holds
  one tensor at a time. Written to a temporary name, then renamed."""
  specs = list(tensors)
  header, offset = {}, 0
  for name, shape, dtype in specs:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  if metadata:
    header["__metadata__"] = metadata
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # data aligned to 8 bytes, as the reference writer does
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype in specs:
      arr = np.ascontiguousarray(np.asarray(fetch(name)).astype(dtype, copy=False))
      if arr.shape != tuple(shape):
        raise SafetensorsError(f"tensor {name}: fetched shape {arr.shape}, declared {shape}")
      f.write(arr.tobytes())
  os.replace(tmp, path)
