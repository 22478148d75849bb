"""Reads a range of a 1-D zarr3 array of a `file://` store straight from its chunk
files into one fresh buffer: one copy, from the page cache into the result. A range
of tokens of the planar `sequences` array (storage/layout.py) is read the same way,
each plane into its own buffer.

Through TensorStore the same read copies each chunk into a buffer of its own, decodes
it into another and copies that into the result, on its thread pools; this is the
read path for local units whose chunks are plain bytes (the `bytes` codec, with or
without a trailing crc32c). It keeps TensorStore's meaning of the files: chunk
`c/K` of the default key encoding, a missing chunk reads as the fill value (or is
an error naming the file, for payload reads), and a chunk file whose size is not the
chunk's is an error (a truncated or foreign file).
It does not verify a chunk's crc32c, so callers use it where the checksum is not
needed: payload arrays without `payload_checksum`, and images, whose content hash is
checked on every read.
"""
from __future__ import annotations

import os

import numpy as np

from knittrans_jax.storage.errors import StoreError

_PREFIX = "file://"


def local_path(url: str) -> str | None:
  """The directory of a `file://` URL (None for any other kvstore)."""
  return url[len(_PREFIX):] if url.startswith(_PREFIX) else None


class ChunkFileError(StoreError):
  """A chunk file that cannot hold what the array says it holds."""


def read_range(array_dir: str, chunk: int, dtype: np.dtype, fill, start: int, stop: int,
               file_bytes: int) -> np.ndarray:
  """Elements [start, stop) of the 1-D array at `array_dir` (chunks of `chunk`
  elements, each file `file_bytes` long: the chunk's bytes plus any checksum). A
  missing chunk reads as `fill`, or is an error naming its file when `fill` is None."""
  dtype = np.dtype(dtype)
  out = np.empty(stop - start, dtype)
  raw = memoryview(out.view(np.uint8))
  size = dtype.itemsize
  prefix = os.path.join(array_dir, "c", "")
  # A read that runs to its chunk's end also reads the rest of the file and one byte
  # past it: the byte count then tells a short or a long file without an fstat.
  tail = bytearray(file_bytes - chunk * size + 1)
  for k in range(start // chunk, -(-stop // chunk)):
    lo, hi = max(start, k * chunk), min(stop, (k + 1) * chunk)
    dst = raw[(lo - start) * size:(hi - start) * size]
    path = prefix + str(k)
    try:
      fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
      if fill is None:
        raise ChunkFileError(f"chunk file {path} is missing") from None
      out[lo - start:hi - start] = fill  # as TensorStore reads a chunk never written
      continue
    try:
      to_end = hi == (k + 1) * chunk
      if not to_end:
        _check_size(fd, path, file_bytes)
      want = len(dst) + (len(tail) - 1 if to_end else 0)
      got = os.preadv(fd, [dst, tail] if to_end else [dst], (lo - k * chunk) * size)
      if got != want:
        _check_size(fd, path, file_bytes)  # names the size when it is the size
        raise ChunkFileError(f"chunk file {path}: read {got} of {want} bytes")
    finally:
      os.close(fd)
  return out


def _check_size(fd: int, path: str, file_bytes: int) -> None:
  have = os.fstat(fd).st_size
  if have != file_bytes:
    raise ChunkFileError(f"chunk file {path} is {have} bytes, not {file_bytes}")


def read_planes(array_dir: str, chunk: int, dtypes: list[np.dtype], start: int, stop: int,
                file_bytes: int) -> list[np.ndarray]:
  """Tokens [start, stop) of a planar array whose chunk files hold `chunk` tokens as
  one plane per dtype, in order (plus `file_bytes` - the planes' bytes of checksum):
  one array per plane. A missing chunk file is an error naming it."""
  outs = [np.empty(stop - start, dt) for dt in dtypes]
  raws = [memoryview(o.view(np.uint8)) for o in outs]
  sizes = [np.dtype(dt).itemsize for dt in dtypes]
  offsets = np.cumsum([0] + [chunk * z for z in sizes])[:-1].tolist()
  prefix = os.path.join(array_dir, "c", "")
  tail = bytearray(file_bytes - offsets[-1] - chunk * sizes[-1] + 1)
  for k in range(start // chunk, -(-stop // chunk)):
    lo, hi = max(start, k * chunk), min(stop, (k + 1) * chunk)
    a, b = lo - start, hi - start
    path = prefix + str(k)
    try:
      fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
      raise ChunkFileError(f"chunk file {path} is missing") from None
    try:
      if hi - lo == chunk:
        # The whole file in one call, straight into the planes; the byte past the
        # file's end tells a short or a long file without an fstat.
        bufs = [r[a * z:b * z] for r, z in zip(raws, sizes)] + [tail]
        got, want = os.preadv(fd, bufs, 0), file_bytes
      else:
        _check_size(fd, path, file_bytes)
        got = want = 0
        for r, z, o in zip(raws, sizes, offsets):
          want += (b - a) * z
          got += os.preadv(fd, [r[a * z:b * z]], o + (lo - k * chunk) * z)
      if got != want:
        _check_size(fd, path, file_bytes)  # names the size when it is the size
        raise ChunkFileError(f"chunk file {path}: read {got} of {want} bytes")
    finally:
      os.close(fd)
  return outs
