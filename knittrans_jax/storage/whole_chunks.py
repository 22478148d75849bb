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
tokens. Its boundary chunk is kept as a whole chunk buffer (`_SeqChunk`, two of
them: an append that moves the tail into a new chunk puts it in the other, so a
failed append never touches the committed tail); an append adds views of its
tokens there, copied into the buffer only when the chunk is wanted whole, so no
append copies the committed tail again (it used to concatenate it, O(chunk) per
append).

A local unit (`local_dir`: `file://`, not `durable`) is written straight to its chunk
files (storage/file_chunks.py). Chunks with a crc32c are replaced whole, as above;
full chunks of new tokens straight from the append's planes. On a local file system
(`in_place`), chunks of `sequences` without one are written in place: only the new
tokens' bytes of each plane. Into the existing file of the boundary chunk:
committed bytes are never written, so a reader (which reads committed bytes only)
and a process killed mid-append see the committed data unchanged. A chunk with no
committed token (a new chunk) is written in place at its own path too: into a file
already there, a file of the array's free pool, or a new file written whole with
the fill value around the new tokens (file_chunks.write_new); nothing is built in
memory for it. Past the committed extent such a chunk holds the fill value, the
bytes of an append that failed or was killed, or (a recycled file) an older chunk's
bytes; the next append overwrites what it needs. A boundary chunk whose file is
missing or not a whole chunk (a damaged file) is replaced whole from the tail.

New chunks take their files from the array's free pool (`{array}/free/`, where
retention puts chunk files it reclaimed: chunk_pool.release, FreePool) when it has
one, so a run in steady state writes into pages the file system already holds: in
place as above, or as the temporary file of a chunk replaced whole. A chunk that
holds committed data never takes one, and a file replaced out of a chunk is deleted,
not put in the pool: a reader may still have it open.

The committed tails are checked when the writer opens the unit: a boundary chunk
that is missing (read as fill values) or damaged is an error, not rewritten with
the fill values as if they were data. Only the committed tokens of a `sequences`
chunk are checked: past them a recycled file holds an older chunk's valid-looking
bytes, which no reader reads (they lie past the commit marker).

A tail becomes the committed one only once its append commits (`commit()`); after a
failed append the next one writes from the committed tail again.
"""
from __future__ import annotations

import bisect
import itertools

import numpy as np
import tensorstore as ts

from knittrans_jax.storage import chunk_pool, file_chunks
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
  elif name == "rows":
    bad = L.rows_damaged(tail)
  elif np.isnan(fill).any():
    bad = np.isnan(tail).any()
  else:
    bad = fill < 0 and tail.size and tail.min() < 0
  if bad:
    raise DamagedTail(f"the committed part of the last chunk of its {name} array is missing "
                      "or damaged; the writer does not append over it")


class _SeqChunk:
  """One chunk of `sequences` in memory, laid out as its file: three planes. Tokens
  [0, dirty) may hold data (committed, or an append's that failed); the rest hold
  the fill value, so `whole` pads by filling only what was written before.

  Tokens are put lazily: `put` keeps views of the appends' planes (the packed arrays
  of an append, which nothing changes after it), copied into the buffer only when
  the chunk is wanted whole (`whole`: a chunk with a crc32c, a remote or damaged
  one), so the usual in-place append copies nothing here; an append packed straight
  into the buffer (`reserve`) leaves nothing to copy at all."""

  def __init__(self, c: int):
    self.buf = np.full(L.SEQ_BYTES * c, L.SEQ_FILL, np.uint8)  # once per writer
    self.raw = [self.buf[o:o + c * dt.itemsize]
                for o, (_, dt) in zip(L.seq_plane_offsets(c), L.SEQ_FIELDS)]
    self.planes = [r.view(dt) for r, (_, dt) in zip(self.raw, L.SEQ_FIELDS)]
    self.dirty = 0
    self._views: list[tuple[int, list[np.ndarray]]] = []  # (at, planes), not yet copied

  def put(self, at: int, planes) -> None:
    """Tokens [at, at + n) from the n tokens' planes (kept as views until wanted)."""
    # Views at or past `at` are a failed append's (tokens below `at` are committed):
    # this put replaces them.
    while self._views and self._views[-1][0] >= at:
      self._views.pop()
    if planes[0].base is not self.buf:  # else packed in place (reserve): nothing to copy
      self._views.append((at, planes))
    self.dirty = max(self.dirty, at + len(planes[0]))

  def reserve(self, at: int, n: int) -> list[np.ndarray]:
    """The planes of tokens [at, at + n), for an append to pack its tokens into."""
    self.dirty = max(self.dirty, at + n)  # whatever lands there: filled when wanted whole
    return [p[at:at + n] for p in self.planes]

  def tokens(self, n: int) -> list[np.ndarray]:
    """The planes of tokens [0, n)."""
    self._copy()
    return [p[:n] for p in self.planes]

  def _copy(self) -> None:
    for at, planes in self._views:
      for dst, src in zip(self.planes, planes):
        dst[at:at + len(src)] = src
    self._views.clear()

  def whole(self, n: int) -> np.ndarray:
    """The chunk file's bytes: tokens [0, n) as put, the fill value after them."""
    self._copy()
    if self.dirty > n:
      for r, (_, dt) in zip(self.raw, L.SEQ_FIELDS):
        r[n * dt.itemsize:self.dirty * dt.itemsize] = L.SEQ_FILL
      self.dirty = n
    return self.buf


class WholeChunkAppender:
  """Tails of the arrays named in `extents` (name -> committed length along axis 0,
  in tokens for the planar `sequences`)."""

  def __init__(self, arrays: dict[str, ts.TensorStore], extents: dict[str, int],
               local_dir: str | None = None, in_place: bool = False):
    self._arrays, self._dir, self._in_place = arrays, local_dir, in_place and local_dir
    # Whole chunks are put in place by a plain rename on tmpfs (file_chunks.no_writeback).
    self.exchange = not local_dir or file_chunks.exchange_in(local_dir)
    self._chunk, self._fill, self._crc, reads = {}, {}, {}, {}
    self._pools: dict[str, chunk_pool.FreePool] = {}
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
    # `sequences`: the boundary chunk in memory (two buffers, so that an append that
    # moves the tail to a new chunk never writes over the committed one), its
    # committed tokens [0, _seq_len) in _seq[_cur].
    self._seq: list[_SeqChunk | None] = [None, None]
    self._seq_offsets = L.seq_plane_offsets(self._chunk.get("sequences", 0))
    self._cur, self._seq_len, self._seq_pending = 0, 0, None
    self._tails = {}
    for name, f in reads.items():
      if name != "sequences":
        self._tails[name] = f.result()
        _check_tail(name, self._tails[name], self._fill[name])
      elif f is not None:
        chunk = self._buffer(0)
        chunk.buf[:] = f.result()
        chunk.dirty = self._chunk[name]  # past the commit: whatever the file held
        self._seq_len = extents[name] % self._chunk[name]
        _check_tail(name, [p[:self._seq_len] for p in chunk.planes], None)
    self._pending: dict[str, np.ndarray] = {}
    # Local arrays other than `sequences`: the boundary chunk's buffer and how far
    # appends wrote into it ([buf, rows]; see _write_boundary), and its file's path.
    self._bufs: dict[str, list] = {}
    self._paths: dict[str, tuple[int, str]] = {}

  def _start(self, name: str, extent: int) -> int:
    return extent - extent % self._chunk[name]

  def _buffer(self, i: int) -> _SeqChunk:
    if self._seq[i] is None:
      self._seq[i] = _SeqChunk(self._chunk["sequences"])
    return self._seq[i]

  def _pool(self, name: str) -> chunk_pool.FreePool:
    """Where new chunks of a local array take their files (chunk_pool.release)."""
    if name not in self._pools:
      self._pools[name] = chunk_pool.FreePool(self._dir + name)
    return self._pools[name]

  def write(self, name: str, extent: int, data: np.ndarray):
    """Writes `data` at [extent, extent + len(data)) as whole chunks; `extent` is the
    committed length of the array (the tail's end). Returns a future."""
    c, tail = self._chunk[name], self._tails[name]
    start = self._start(name, extent)
    if extent - start != len(tail):
      raise AssertionError(f"{name}: tail of {len(tail)} rows, but the extent {extent} leaves "
                           f"{extent - start} in its chunk")
    end = extent + len(data)
    if self._dir is not None and end < start + c:
      return self._write_boundary(name, start, extent, end, data)
    self._bufs.pop(name, None)  # the tail moves to another chunk (or a fresh array)
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
        # A chunk without committed rows takes a free file, if its array has one.
        pool = self._pool(name) if start + i >= extent else None
        file_chunks.replace(file_chunks.chunk_path(self._dir + name, (start + i) // c, block.ndim),
                            block[i:i + c], self._crc[name], pool, self.exchange)
    except Exception as e:
      return Written(e)
    return Written()

  def _write_boundary(self, name: str, start: int, extent: int, end: int, data: np.ndarray):
    """A local write that ends in the boundary chunk: that chunk, replaced whole from
    its buffer (`_bufs`: the committed tail, then the fill value past the rows any
    append wrote), with only the new rows copied in. The committed rows are not
    written into (the new ones go past them), so the tail is a view of the buffer."""
    c, tail, fill = self._chunk[name], self._tails[name], self._fill[name]
    j, m = extent - start, end - start
    entry = self._bufs.get(name)
    if entry is None:  # once per chunk: the tail, then the fill value
      buf = np.empty((c, *tail.shape[1:]), tail.dtype)
      buf[:j], buf[j:] = tail, fill
      entry = self._bufs[name] = [buf, j]
    buf, dirty = entry
    buf[j:m] = data
    if dirty > m:  # a failed append's rows past this one's
      buf[m:dirty] = fill
    entry[1] = m
    self._pending[name] = buf[:m]  # later appends write past it only
    k, path = start // c, self._paths.get(name)
    if path is None or path[0] != k:
      path = self._paths[name] = (k, file_chunks.chunk_path(self._dir + name, k, buf.ndim))
    path = path[1]
    try:
      # A chunk without committed rows takes a free file, if its array has one.
      file_chunks.replace(path, buf, self._crc[name], self._pool(name) if j == 0 else None,
                          self.exchange)
    except Exception as e:
      return Written(e)
    return Written()

  def write_bytes(self, name: str, extent: int, blobs: list[np.ndarray]):
    """Writes the bytes of `blobs` (C-contiguous uint8 arrays, in order) at [extent,
    extent + their total) of the 1-D uint8 array `name` (images/data), as `write`
    writes their concatenation, without making it: each chunk file is written from
    the blobs' own bytes (a gathered write). Without a crc32c on a local file system
    a chunk is written in place, as `sequences` is (committed bytes never written; a
    new chunk into a free or new file: file_chunks.write_new); otherwise replaced
    whole (the tail, the new bytes, the fill value). An image copy per trajectory
    (dedup_images=False) is hundreds of MB an append, which joining copied once and
    `write`'s padded block again, into fresh pages each time. Returns a future.
    Through TensorStore the blobs are joined and written by `write`."""
    if self._dir is None:
      return self.write(name, extent, np.concatenate(blobs))
    c, tail = self._chunk[name], self._tails[name]
    start = self._start(name, extent)
    if extent - start != len(tail):
      raise AssertionError(f"{name}: tail of {len(tail)} bytes, but the extent {extent} "
                           f"leaves {extent - start} in its chunk")
    self._bufs.pop(name, None)  # _write_boundary's copy of the tail: stale from here on
    views = [memoryview(b).cast("B") for b in blobs]
    starts = list(itertools.accumulate((len(v) for v in views), initial=0))
    n = starts[-1]
    end = extent + n

    def take(r0: int, r1: int) -> list[memoryview]:  # the blobs' bytes [r0, r1) of the call
      got, i = [], bisect.bisect_right(starts, r0) - 1
      while r0 < r1:
        a, b = r0 - starts[i], min(r1, starts[i + 1]) - starts[i]
        if b > a:
          got.append(views[i][a:b])
        r0, i = starts[i] + b, i + 1
      return got

    fill, crc = int(self._fill[name]), self._crc[name]
    in_place = self._in_place and not crc
    try:
      for k in range(start // c, -(-end // c)):
        path = file_chunks.chunk_path(self._dir + name, k, 1)
        lo, hi = max(extent, k * c), min(end, (k + 1) * c)  # the new bytes of chunk k
        new, committed = take(lo - extent, hi - extent), k * c < extent

        def whole() -> list:  # the chunk's bytes, in file order
          pad = [file_chunks.fill_bytes(fill, (k + 1) * c - hi)] if hi < (k + 1) * c else []
          return ([memoryview(tail)] if committed else []) + new + pad

        if in_place:
          pieces = list(zip(itertools.accumulate((len(v) for v in new), initial=lo - k * c), new))
          if not committed:
            file_chunks.write_new(path, c, pieces, fill, self._pool(name))
          elif not file_chunks.update(path, c, pieces):  # missing or damaged: whole
            file_chunks.replace(path, whole(), False, None, self.exchange)
        else:
          file_chunks.replace(path, whole(), crc, None if committed else self._pool(name),
                              self.exchange)
    except Exception as e:
      return Written(e)
    last = end - end % c  # the new tail: bytes [last, end), if the last chunk is part filled
    keep = [tail] if last == start else []
    self._pending[name] = np.concatenate(
        keep + [np.frombuffer(v, np.uint8) for v in take(max(last, extent) - extent, n)]
        if end > last else [tail[:0]])
    return Written()

  def reserve_sequences(self, extent: int, n: int) -> list[np.ndarray] | None:
    """Where an append of n tokens at `extent` packs them (validation.pack_append's
    `out`): the boundary chunk's buffer, if they end in that chunk and it is written
    in place; None otherwise (they are packed into new arrays). Packed there, the
    tokens are copied once and into pages the writer already holds; new arrays,
    kept as the tail until the chunk is done, were fresh pages on every append,
    which cost more than the copy itself."""
    c = self._chunk["sequences"]
    j = extent % c
    if (not self._in_place or self._crc["sequences"] or j != self._seq_len
        or j + n >= c):
      return None
    return self._buffer(self._cur).reserve(j, n)

  def write_sequences(self, extent: int, planes: tuple[np.ndarray, ...]):
    """Writes tokens [extent, extent + n) of `sequences` as whole chunks: `planes` are
    the n tokens' ids, log-probs and loss mask (SEQ_FIELDS order and dtypes). Returns
    a future. The planes must not change after the call: the writer keeps views of
    them as the tail (unit_writer passes the arrays it packed for this append).

    The new tokens of the in-memory boundary chunk (if the append ends in it), else
    of its last, partly filled chunk (the next tail, in the other buffer), are kept
    there; full chunks go to their files straight from `planes`."""
    c, j = self._chunk["sequences"], self._seq_len
    start = extent - extent % c
    if extent - start != j:
      raise AssertionError(f"sequences: tail of {j} tokens, but the extent {extent} "
                           f"leaves {extent - start} in its chunk")
    planes = tuple(np.ascontiguousarray(p, dt) for p, (_, dt) in zip(planes, L.SEQ_FIELDS))
    end = extent + len(planes[0])
    last = end - end % c  # the first token of the partly filled last chunk
    cur = self._buffer(self._cur)
    if end < start + c:  # ends in the boundary chunk
      cur.put(j, planes)
      self._seq_pending, staged = (self._cur, end - start), True
    else:
      if end > last:
        self._buffer(1 - self._cur).put(0, [p[last - extent:] for p in planes])
      self._seq_pending, staged = (1 - self._cur, end - last), False

    def boundary() -> np.ndarray:  # chunk start // c, whole, from the committed tail
      if not staged:
        cur.put(j, [p[:start + c - extent] for p in planes])
      return cur.whole(min(end, start + c) - start)

    if self._dir is None:
      block = self._chunks_of(start, end, cur.tokens(j), planes, extent)
      lo = start * L.SEQ_BYTES
      return self._arrays["sequences"][lo:lo + block.size].write(block.reshape(-1))
    crc = self._crc["sequences"]
    whole = crc or not self._in_place
    pool = self._pool("sequences")
    try:
      offsets, prefix = self._seq_offsets, self._dir + "sequences/c/"
      for k in range(start // c, -(-end // c)):
        path = prefix + str(k)  # file_chunks.chunk_path of a 1-D array
        lo, hi = max(extent, k * c), min(end, (k + 1) * c)  # the new tokens of chunk k
        new = [p[lo - extent:hi - extent] for p in planes]
        if whole:
          if k * c < extent:  # holds committed tokens
            file_chunks.replace(path, boundary(), crc, None, self.exchange)
          elif hi < (k + 1) * c:  # the partly filled last chunk, in a buffer
            file_chunks.replace(path, self._seq[self._seq_pending[0]].whole(hi - k * c), crc,
                                pool, self.exchange)
          else:  # a full chunk of new tokens: its planes in file order
            file_chunks.replace(path, [memoryview(p).cast("B") for p in new], crc, pool,
                                self.exchange)
          continue
        pieces = [(o + (lo - k * c) * dt.itemsize, memoryview(p).cast("B"))
                  for o, (_, dt), p in zip(offsets, L.SEQ_FIELDS, new)]
        if k * c >= extent:
          # A new chunk: no committed byte in it, so it is written in place at its path
          # even when its file is a recycled one. The bytes past the new tokens are then
          # an old chunk's: past the commit marker, which no reader reads past, and
          # which the writer's check of a boundary chunk (_check_tail) does not read
          # either; later appends write every token below their commit first.
          file_chunks.write_new(path, L.SEQ_BYTES * c, pieces, L.SEQ_FILL, pool)
        elif not file_chunks.update(path, L.SEQ_BYTES * c, pieces):
          file_chunks.replace(path, boundary(), False, None, self.exchange)  # damaged: whole
    except Exception as e:
      return Written(e)
    return Written()

  def _chunks_of(self, first: int, end: int, tail, planes, extent: int) -> np.ndarray:
    """Whole chunks [first // c, ceil(end / c)) of `sequences`, uint8 [chunks, bytes]:
    the tail (if `first` is the boundary chunk's start), the planes' tokens from
    `extent` on, and the fill value past `end`. For kvstores other than local files."""
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
    if self._seq_pending is not None:
      self._cur, self._seq_len = self._seq_pending
      self._seq_pending = None

  def discard(self) -> None:
    """The append failed: the next one starts again from the committed tails."""
    self._pending.clear()
    self._seq_pending = None
