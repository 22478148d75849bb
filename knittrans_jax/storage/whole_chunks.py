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

A tail becomes the committed one only once its append commits (`commit()`); after a
failed append the next one writes from the committed tail again.
"""
from __future__ import annotations

import numpy as np
import tensorstore as ts

from knittrans_jax.storage import layout as L


class WholeChunkAppender:
  """Tails of the arrays named in `extents` (name -> committed length along axis 0,
  in tokens for the planar `sequences`)."""

  def __init__(self, arrays: dict[str, ts.TensorStore], extents: dict[str, int]):
    self._arrays = arrays
    self._chunk, self._fill, reads = {}, {}, {}
    for name, n in extents.items():
      rows = arrays[name].chunk_layout.write_chunk.shape[0]
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

  def write(self, name: str, extent: int, data: np.ndarray) -> ts.Future:
    """Writes `data` at [extent, extent + len(data)) as whole chunks; `extent` is the
    committed length of the array (the tail's end)."""
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
    return self._arrays[name][start:padded_end].write(block)

  def write_sequences(self, extent: int, planes: tuple[np.ndarray, ...]) -> ts.Future:
    """Writes tokens [extent, extent + n) of `sequences` as whole chunks: `planes` are
    the n tokens' ids, log-probs and loss mask (SEQ_FIELDS order and dtypes)."""
    c, tail = self._chunk["sequences"], self._tails["sequences"]
    start = extent - extent % c
    if extent - start != len(tail[0]):
      raise AssertionError(f"sequences: tail of {len(tail[0])} tokens, but the extent {extent} "
                           f"leaves {extent - start} in its chunk")
    used = extent - start + len(planes[0])  # tokens from the first chunk's start
    chunks = -(-used // c)
    block = np.full((chunks, L.SEQ_BYTES * c), L.SEQ_FILL, np.uint8)
    pending = []
    for o, (_, dt), old, new in zip(L.seq_plane_offsets(c), L.SEQ_FIELDS, tail, planes):
      values = np.concatenate([old, np.asarray(new, dt)]).view(np.uint8)
      w = c * dt.itemsize
      full = used // c
      block[:full, o:o + w] = values[:full * w].reshape(full, w)
      if full < chunks:  # the last chunk, partly filled
        block[full, o:o + (used - full * c) * dt.itemsize] = values[full * w:]
      pending.append(values[full * w:].view(dt).copy())
    self._pending["sequences"] = tuple(pending)
    lo = start // c * L.SEQ_BYTES * c
    return self._arrays["sequences"][lo:lo + block.size].write(block.reshape(-1))

  def commit(self) -> None:
    """The append's writes are committed: their tails are the committed ones now."""
    self._tails.update(self._pending)
    self._pending.clear()

  def discard(self) -> None:
    """The append failed: the next one starts again from the committed tails."""
    self._pending.clear()
