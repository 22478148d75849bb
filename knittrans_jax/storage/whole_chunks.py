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

A tail becomes the committed one only once its append commits (`commit()`); after a
failed append the next one writes from the committed tail again.
"""
from __future__ import annotations

import numpy as np
import tensorstore as ts


class WholeChunkAppender:
  """Tails of the arrays named in `extents` (name -> committed length along axis 0)."""

  def __init__(self, arrays: dict[str, ts.TensorStore], extents: dict[str, int]):
    self._arrays = arrays
    self._chunk = {name: arrays[name].chunk_layout.write_chunk.shape[0] for name in extents}
    self._fill = {name: np.asarray(arrays[name].fill_value) for name in extents}
    reads = {name: arrays[name][self._start(name, n):n].read() for name, n in extents.items()}
    self._tails = {name: f.result() for name, f in reads.items()}
    self._pending: dict[str, np.ndarray] = {}

  def _start(self, name: str, extent: int) -> int:
    return extent - extent % self._chunk[name]

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

  def commit(self) -> None:
    """The append's writes are committed: their tails are the committed ones now."""
    self._tails.update(self._pending)
    self._pending.clear()

  def discard(self) -> None:
    """The append failed: the next one starts again from the committed tails."""
    self._pending.clear()
