"""Appends to a unit's arrays in whole chunks only.

An append writes past the committed extent of arrays chunked along their first
axis. Written as is, its first chunk is partly committed data, so TensorStore reads
that chunk back (and writes it conditionally) before replacing it, and its last
chunk is partly new. Here the writer keeps each array's committed part of its
boundary chunk (the tail) in memory and writes from that chunk's start, padded with
the array's fill value to the end of its last chunk: every chunk is written whole,
unconditionally, with nothing read back. The boundary chunk is still replaced
atomically with its committed bytes unchanged (they are the tail's), and what lies
past the data is the fill value, as TensorStore would have written it.

The planar `sequences` array (storage/layout.py) is appended to the same way, in
tokens: its tail is the committed tokens of the boundary chunk, one array per plane,
and each chunk written is assembled from the planes.

A local unit (`local_dir`: `file://`, not `durable`) is written straight to its chunk
files (storage/file_chunks.py). Chunks with a crc32c are replaced whole, as above.
On a local file system (`in_place`), chunks of `sequences` without one are written
in place: only the new tokens' bytes of each plane, into the existing file of the
boundary chunk; committed bytes are never written, so a reader (which reads
committed bytes only) and a process killed mid-append see the committed data
unchanged. Past the committed extent such a chunk holds the fill value or the
bytes of an append that failed or was killed, which the next append overwrites. A
chunk whose file is missing or not a whole chunk (the first append to it; a
damaged file) is replaced whole.

The committed tails are checked when the writer opens the unit: a boundary chunk
that is missing (read as fill values) or damaged is an error, not rewritten with
the fill values as if they were data.

A tail becomes the committed one only once its append commits (`commit()`); after a
failed append the next one writes from the committed tail again.
"""
from __future__ import annotations

import numpy as np
import tensorstore as ts

from knittrans_jax.storage import file_chunks
from knittrans_jax.storage import layout as L


class Written:
  """A direct write, done (or failed) when issued, with a TensorStore future's face."""

  def __init__(self, error: Exception | None = None):
    self._error = error

  def result(self):
    if self._error is not None:
      raise self._error


class DamagedTail(ValueError):
  """The committed part of a boundary chunk holds values no writer stores."""


def _check_tail(name: str, tail, fill) -> None:
  if name == "sequences":
    bad = L.sequences_damaged(*tail)
  elif np.isnan(fill).any():
    bad = np.isnan(tail).any()
  else:
    bad = fill < 0 and tail.size and tail.min() < 0
  if bad:
    raise DamagedTail(f"the committed part of the last chunk of its {name} array is missing "
                      "or damaged; the writer does not append over it")


class WholeChunkAppender:
  """Tails of the arrays named in `extents` (name -> committed length along axis 0,
  in tokens for the planar `sequences`)."""

  def __init__(self, arrays: dict[str, ts.TensorStore], extents: dict[str, int],
               local_dir: str | None = None, in_place: bool = False):
    self._arrays, self._dir, self._in_place = arrays, local_dir, in_place and local_dir
    self._chunk, self._fill, self._crc, reads = {}, {}, {}, {}
    for name, n in extents.items():
      rows = arrays[name].chunk_layout.write_chunk.shape[0]
      self._crc[name] = any(c["name"] == "crc32c" for c in arrays[name].codec.to_json()["codecs"])
      if name == "sequences":  # chunks of `rows` bytes, token_chunk tokens
        self._chunk[name] = rows // L.SEQ_BYTES
        k = n // self._chunk[name]
        reads[name] = arrays[name][k * rows:(k + 1) * rows].read() if n % self._chunk[name] else None
      else:
        self._chunk[name] = rows
        self._fill[name] = np.asarray(arrays[name].fill_value)
        reads[name] = arrays[name][self._start(name, n):n].read()
    self._tails = {name: self._planes_of(f.result() if f else None, extents[name])
                   if name == "sequences" else f.result() for name, f in reads.items()}
    for name, tail in self._tails.items():
      _check_tail(name, tail, self._fill.get(name))
    self._pending: dict[str, np.ndarray | tuple[np.ndarray, ...]] = {}

  def _start(self, name: str, extent: int) -> int:
    return extent - extent % self._chunk[name]

  def _planes_of(self, chunk_bytes: np.ndarray | None, extent: int) -> tuple[np.ndarray, ...]:
    """The committed tokens of the boundary chunk of `sequences`, one array per plane."""
    c, j = self._chunk["sequences"], extent % self._chunk["sequences"]
    if chunk_bytes is None:
      return tuple(np.zeros(0, dt) for _, dt in L.SEQ_FIELDS)
    return tuple(chunk_bytes[o:o + j * dt.itemsize].view(dt)
                 for o, (_, dt) in zip(L.seq_plane_offsets(c), L.SEQ_FIELDS))

  def write(self, name: str, extent: int, data: np.ndarray):
    """Writes `data` at [extent, extent + len(data)) as whole chunks; `extent` is the
    committed length of the array (the tail's end). Returns a future."""
    c, tail = self._chunk[name], self._tails[name]
    start = self._start(name, extent)
    if extent - start != len(tail):
      raise AssertionError(f"{name}: tail of {len(tail)} rows, but the extent {extent} leaves "
                           f"{extent - start} in its chunk")
    end = extent + len(data)
    padded_end = -(-end // c) * c
    block = np.empty((padded_end - start, *data.shape[1:]), data.dtype)
    block[:len(tail)] = tail
    block[len(tail):len(tail) + len(data)] = data
    block[len(tail) + len(data):] = self._fill[name]
    self._pending[name] = block[end - start - end % c:end - start].copy()
    if self._dir is None:
      return self._arrays[name][start:padded_end].write(block)
    try:
      for i in range(0, len(block), c):
        file_chunks.replace(file_chunks.chunk_path(self._dir + name, (start + i) // c, block.ndim),
                            block[i:i + c], self._crc[name])
    except Exception as e:
      return Written(e)
    return Written()

  def write_sequences(self, extent: int, planes: tuple[np.ndarray, ...]):
    """Writes tokens [extent, extent + n) of `sequences` as whole chunks: `planes` are
    the n tokens' ids, log-probs and loss mask (SEQ_FIELDS order and dtypes). Returns
    a future."""
    c, tail = self._chunk["sequences"], self._tails["sequences"]
    start = extent - extent % c
    if extent - start != len(tail[0]):
      raise AssertionError(f"sequences: tail of {len(tail[0])} tokens, but the extent {extent} "
                           f"leaves {extent - start} in its chunk")
    planes = tuple(np.ascontiguousarray(p, dt) for p, (_, dt) in zip(planes, L.SEQ_FIELDS))
    end = extent + len(planes[0])
    last = end - end % c  # the first token of the partly filled last chunk
    self._pending["sequences"] = tuple(
        np.concatenate([t, p]) if last == start else p[last - extent:].copy()
        for t, p in zip(tail, planes))
    whole = self._dir is None or self._crc["sequences"] or not self._in_place
    if whole:
      block = self._chunks_of(start, end, tail, planes, extent)
      if self._dir is None:
        lo = start * L.SEQ_BYTES
        return self._arrays["sequences"][lo:lo + block.size].write(block.reshape(-1))
    try:
      offsets = L.seq_plane_offsets(c)
      for k in range(start // c, -(-end // c)):
        path = file_chunks.chunk_path(self._dir + "sequences", k, 1)
        if whole:
          file_chunks.replace(path, block[k - start // c], self._crc["sequences"])
          continue
        lo, hi = max(extent, k * c), min(end, (k + 1) * c)  # the new tokens of chunk k
        pieces = [(o + (lo - k * c) * dt.itemsize,
                   memoryview(p[lo - extent:hi - extent]).cast("B"))
                  for o, (_, dt), p in zip(offsets, L.SEQ_FIELDS, planes)]
        if not file_chunks.update(path, L.SEQ_BYTES * c, pieces):
          one = self._chunks_of(k * c, hi, tail if k * c == start else None, planes, extent)
          file_chunks.replace(path, one[0], False)
    except Exception as e:
      return Written(e)
    return Written()

  def _chunks_of(self, first: int, end: int, tail, planes, extent: int) -> np.ndarray:
    """Whole chunks [first // c, ceil(end / c)) of `sequences`, uint8 [chunks, bytes]:
    the tail (if `first` is the boundary chunk's start), the planes' tokens from
    `extent` on, and the fill value past `end`."""
    c = self._chunk["sequences"]
    chunks = -(-end // c) - first // c
    block = np.full((chunks, L.SEQ_BYTES * c), L.SEQ_FILL, np.uint8)
    for o, (_, dt), old, new in zip(L.seq_plane_offsets(c), L.SEQ_FIELDS,
                                    tail if tail is not None else [None] * 3, planes):
      values = new[max(first - extent, 0):end - extent]
      if old is not None:
        values = np.concatenate([old, values])
      flat, w = values.view(np.uint8), c * dt.itemsize
      full = len(values) // c
      block[:full, o:o + w] = flat[:full * w].reshape(full, w)
      if full < chunks:  # the last chunk, partly filled
        block[full, o:o + (len(values) - full * c) * dt.itemsize] = flat[full * w:]
    return block

  def commit(self) -> None:
    """The append's writes are committed: their tails are the committed ones now."""
    self._tails.update(self._pending)
    self._pending.clear()

  def discard(self) -> None:
    """The append failed: the next one starts again from the committed tails."""
    self._pending.clear()
