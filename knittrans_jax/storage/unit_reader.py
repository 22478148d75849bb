"""Reads the committed part of one storage unit: metadata listing and payload reads.

Every read is bounded by the commit marker read first, so a reader running beside
the unit's writer never sees a partial row. Committed rows and image-table rows
never change, so what is read of them is cached.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorstore as ts

from knittrans_jax.storage import file_chunks
from knittrans_jax.storage import layout as L
from knittrans_jax.storage.commit import Commit, read_commit
from knittrans_jax.storage.errors import CorruptUnitError
from knittrans_jax.storage.images import hash_to_hex, image_id
from knittrans_jax.storage.retention import ReclaimedRowError, Records
from knittrans_jax.storage.schema import StoreSchema
from knittrans_jax.types import TrajMeta


class UnitReader:

  def __init__(self, root: str, unit: str, schema: StoreSchema):
    self.unit = L.check_unit_name(unit)
    self.schema = schema
    self._url = L.join(root, unit)
    # `rows` and `turns` are opened once the marker says the unit is of this format.
    self._opened_format_arrays = False
    common = set(L.unit_arrays(self._url, schema)) - set(L.FORMAT_ARRAYS)
    try:
      self.arrays = L.open_unit_arrays(self._url, schema, create=False, names=common)
    except Exception as e:
      raise CorruptUnitError(unit, f"cannot open its arrays: {e}") from e
    # Image table rows are immutable once committed, so they are cached.
    # From image-table row `_image_base` on (rows below it may be reclaimed).
    self._image_base = self._live_images = 0
    self._image_ids: list[str] = []
    self._image_rows = np.zeros((0, L.IMG_COLS), np.int64)
    self._image_pos: dict[str, int] = {}
    self._row_refs: dict[int, np.ndarray] = {}  # row -> image-table indices (no-dedup stores)
    self.image_hash = image_id
    self._dir = file_chunks.local_path(L.join(root, unit))  # None: not a file:// store
    self._records = Records(unit, self._url, schema.durable)
    self._retains = schema.retention != "all"

  def watermark(self) -> int:
    """The unit's low watermark: rows below it may be reclaimed (storage/retention.py)."""
    return self._records.watermark() if self._retains else 0

  def check_rows(self, first: int) -> None:
    """Raises ReclaimedRowError if row `first` (a unit's lowest row asked for) is
    below the low watermark."""
    w = self.watermark()
    if first < w:
      raise ReclaimedRowError(self.unit, first, w)

  def commit(self) -> Commit:
    commit = read_commit(self.unit, self.arrays["commit"], allow_missing=False)
    if not self._opened_format_arrays:  # an older format was refused by the marker
      try:
        self.arrays.update(L.open_unit_arrays(self._url, self.schema, False,
                                              names=L.FORMAT_ARRAYS))
      except Exception as e:
        raise CorruptUnitError(self.unit, f"cannot open its row array: {e}") from e
      self._opened_format_arrays = True
    return commit

  def _read(self, name: str, start: int, stop: int, batch=None) -> ts.Future:
    return self.arrays[name][start:stop].read(batch=batch)

  def _result(self, future: ts.Future, what: str) -> np.ndarray:
    try:
      return future.result()
    except Exception as e:
      raise CorruptUnitError(self.unit, f"reading {what} failed: {e}") from e

  def read_flat(self, name: str, start: int, stop: int, batch=None,
                checked_elsewhere: bool = False):
    """A future of elements [start, stop) of a 1-D payload array (images/data).
    A local unit is read straight from its chunk files
    (storage/file_chunks.py), at once, unless the array's crc32c must be verified
    here (`payload_checksum`, and the caller does not check the bytes itself); a
    missing chunk is then an error naming its file, unless the caller checks the
    bytes (images: their hash). Through TensorStore it reads as the fill value."""
    if self._dir is None or (self.schema.payload_checksum and not checked_elsewhere):
      return self._read(name, start, stop, batch)
    array = self.arrays[name]
    chunk = array.chunk_layout.write_chunk.shape[0]
    dtype = array.dtype.numpy_dtype
    fill = array.fill_value if checked_elsewhere else None
    try:
      return _Ready(file_chunks.read_range(
          self._dir + name, chunk, dtype, fill, start, stop,
          chunk * dtype.itemsize + 4 * self.schema.payload_checksum))
    except (OSError, file_chunks.ChunkFileError) as e:
      return _Ready(error=e)

  def read_sequences(self, start: int, stop: int, batch=None):
    """A future of tokens [start, stop): (ids, log-probs, loss mask), one array each.

    Each chunk of the planar `sequences` array is read once for all three: straight
    from its file for a local unit (checking its crc32c, if it has one), else whole
    chunks through TensorStore, split into planes here."""
    array, dtypes = self.arrays["sequences"], [dt for _, dt in L.SEQ_FIELDS]
    chunk = array.chunk_layout.write_chunk.shape[0] // L.SEQ_BYTES
    if self._dir is not None:
      crc = self.schema.payload_checksum
      try:
        return _Ready(tuple(file_chunks.read_planes(
            self._dir + "sequences", chunk, dtypes, start, stop, L.SEQ_BYTES * chunk + 4 * crc,
            crc)))
      except (OSError, file_chunks.ChunkFileError) as e:
        return _Ready(error=e)
    k0, k1 = start // chunk, -(-stop // chunk)
    width = L.SEQ_BYTES * chunk
    return _Planes(array[k0 * width:k1 * width].read(batch=batch), chunk,
                   start - k0 * chunk, stop - k0 * chunk)

  def refresh_images(self, commit: Commit | None = None) -> None:
    commit = commit or self.commit()
    have = self._image_base + len(self._image_ids)
    if commit.images <= have:
      return
    first = self._live_images
    if not self._image_ids and self._retains:
      # A first read: from the reclaimed floor (the row before the first kept image,
      # whose end is that image's start).
      first = self._records.floors()[0].images
      have = self._image_base = max(first - 1, 0)
      self._live_images = first
    with ts.Batch() as batch:
      fh = self._read("images/hash", have, commit.images, batch)
      fi = self._read("images/index", have, commit.images, batch)
    try:
      hashes, rows = self._result(fh, "images/hash"), self._result(fi, "images/index")
      if (rows[:, L.IMG_BYTE_END] < 0).any() or rows[-1, L.IMG_BYTE_END] != commit.image_bytes:
        raise CorruptUnitError(self.unit, "image index disagrees with the commit marker")
    except CorruptUnitError:
      if not self._image_ids and self._retains and self._records.floors()[0].images > first:
        self._image_base = 0  # reclaimed while this read ran: from the new floor
        return self.refresh_images(commit)
      raise
    new_ids = [hash_to_hex(h) for h in hashes]
    # The image before the first kept one is reclaimed: its row gives offsets only.
    live = self._live_images
    self._image_pos.update({iid: have + k for k, iid in enumerate(new_ids) if have + k >= live})
    self._image_ids += new_ids
    self._image_rows = np.concatenate([self._image_rows, rows])

  def image_ids(self) -> list[str]:
    """The ids of the image table's rows, from its first row not reclaimed."""
    self.refresh_images()
    return list(self._image_ids[self._live_images - self._image_base:])

  def list(self, start: int = 0, stop: int | None = None) -> list[TrajMeta]:
    """Metadata of committed rows [start, stop) (stop defaults to the commit)."""
    if start < 0 or (stop is not None and stop < 0):
      raise ValueError(f"list(start={start}, stop={stop}): rows are numbered from 0")
    commit = self.commit()
    stop = commit.rows if stop is None else min(stop, commit.rows)
    if start >= stop:
      return []
    self.check_rows(start)
    lo = max(start - 1, 0)  # one row earlier gives this range's start offsets
    f_rows = self._read("rows", lo, stop)
    try:
      return self._list(commit, start, stop, self._result(f_rows, "rows"))
    except CorruptUnitError:
      self.check_rows(start)  # reclaimed while this read ran, not damaged
      raise

  def _list(self, commit: Commit, start: int, stop: int, rows: np.ndarray) -> list[TrajMeta]:
    prev = rows[0] if start > 0 else np.zeros(L.ROW_COLS, np.int64)
    rows = rows[1:] if start > 0 else rows
    reward = L.rows_reward(rows)
    tok_end, ref_end = rows[:, L.TOK_END], rows[:, L.REF_END]
    tok_start = np.concatenate([[prev[L.TOK_END]], tok_end[:-1]])
    ref_start = np.concatenate([[prev[L.REF_END]], ref_end[:-1]])
    lengths = rows[:, L.PROMPT_LEN] + rows[:, L.RESPONSE_LEN]
    if (L.rows_damaged(rows)
        or (tok_end - tok_start != lengths).any() or tok_end[-1] > commit.tokens
        or ref_end[-1] > commit.refs
        or (rows[:, L.SOURCE] >= len(self.schema.sources)).any()
        or (rows[:, L.LOSS_TOKENS] > rows[:, L.RESPONSE_LEN]).any()):
      raise CorruptUnitError(self.unit, f"row columns [{start}, {stop}) are inconsistent "
                             "(a chunk is missing or damaged)")
    turns = self._turns(commit, rows, prev)
    refs = np.zeros(0, np.int64)
    if ref_end[-1] > ref_start[0]:
      refs = self._result(self._read("image_refs", int(ref_start[0]), int(ref_end[-1])),
                          "image_refs")
      self.refresh_images(commit)
      if (refs < self._live_images).any() or (refs >= self._image_end()).any():
        raise CorruptUnitError(self.unit, "image references point outside the image table")
    base, ib = ref_start[0], self._image_base
    if not self.schema.dedup_images:  # reads locate each row's own copies from these
      for r in range(stop - start):
        self._row_refs[start + r] = refs[ref_start[r] - base:ref_end[r] - base]
    sources = self.schema.sources
    loss = rows[:, L.LOSS_TOKENS].tolist()
    gen, env = rows[:, L.GEN_US].tolist(), rows[:, L.ENV_US].tolist()
    return [TrajMeta(
        unit=self.unit, row=start + r, token_start=int(tok_start[r]),
        prompt_len=int(rows[r, L.PROMPT_LEN]), response_len=int(rows[r, L.RESPONSE_LEN]),
        source=sources[rows[r, L.SOURCE]], group_id=int(rows[r, L.GROUP_ID]),
        index_in_group=int(rows[r, L.INDEX_IN_GROUP]), version_first=int(rows[r, L.V_FIRST]),
        version_last=int(rows[r, L.V_LAST]), reward=float(reward[r]),
        image_ids=tuple(self._image_ids[i - ib]
                        for i in refs[ref_start[r] - base:ref_end[r] - base]),
        loss_tokens=loss[r], turns=turns[r], gen_seconds=gen[r] / 1e6, env_seconds=env[r] / 1e6)
        for r in range(stop - start)]

  def _turns(self, commit: Commit, rows: np.ndarray, prev: np.ndarray) -> list[tuple]:
    """The turns of listed rows, checked against their rows."""
    end = rows[:, L.TURN_END]
    start = np.concatenate([[prev[L.TURN_END]], end[:-1]])
    if (end < start).any() or end[-1] > commit.turns:
      raise CorruptUnitError(self.unit, "turn ends of rows are inconsistent with the commit "
                             f"marker ({commit.turns} turns committed)")
    if end[-1] == start[0]:
      return [()] * len(rows)
    table = self._result(self._read("turns", int(start[0]), int(end[-1])), "turns")
    owner = np.repeat(np.arange(len(rows)), end - start)
    lo, hi = table[:, L.TURN_START], table[:, L.TURN_STOP]
    v0, v1 = table[:, L.TURN_V_FIRST], table[:, L.TURN_V_LAST]
    if ((lo < 0).any() or (lo >= hi).any() or (hi > rows[owner, L.RESPONSE_LEN]).any()
        or (v0 > v1).any() or (v0 < rows[owner, L.V_FIRST]).any()
        or (v1 > rows[owner, L.V_LAST]).any()):
      raise CorruptUnitError(self.unit, "the turns table disagrees with its rows (a chunk is "
                             "missing or damaged)")
    return L.turn_spans(table, start - start[0], end - start)

  def _image_end(self) -> int:
    return self._image_base + len(self._image_ids)

  def image_row(self, image_id: str) -> int:
    """The image table row that holds `image_id` (with dedup, its only copy)."""
    if image_id not in self._image_pos:
      self.refresh_images()
    if image_id not in self._image_pos:
      raise KeyError(f"image {image_id} is not in unit '{self.unit}'")
    return self._image_pos[image_id]

  def image_at(self, k: int) -> tuple[int, int, np.dtype, tuple[int, ...]]:
    """(byte start, byte end, dtype, shape) of row k of the (refreshed) image table."""
    j = k - self._image_base
    row = self._image_rows[j]
    start = int(self._image_rows[j - 1, L.IMG_BYTE_END]) if k else 0
    shape = tuple(int(d) for d in row[L.IMG_DIM0:L.IMG_DIM0 + row[L.IMG_NDIM]])
    return start, int(row[L.IMG_BYTE_END]), L.IMAGE_DTYPES[row[L.IMG_DTYPE]], shape

  def image_id_at(self, k: int) -> str:
    return self._image_ids[k - self._image_base]

  def row_image_refs(self, rows: Sequence[int]) -> dict[int, np.ndarray]:
    """Image-table indices of each committed row's images, in the row's order.

    Rows not listed through this reader are read here: their ref ends, then their
    refs, each in one batch over runs of consecutive rows.
    """
    need = sorted({r for r in rows if r not in self._row_refs})
    if need:
      commit = self.commit()
      if need[0] < 0 or need[-1] >= commit.rows:
        raise CorruptUnitError(self.unit, f"rows {need[0]}..{need[-1]} asked for, but "
                               f"{commit.rows} are committed")
      runs = [[need[0], need[0] + 1]]
      for r in need[1:]:
        if r == runs[-1][1]:
          runs[-1][1] = r + 1
        else:
          runs.append([r, r + 1])
      with ts.Batch() as batch:  # one row earlier gives each run's first start
        f_rows = [self._read("rows", max(lo - 1, 0), hi, batch) for lo, hi in runs]
      ends = []
      for (lo, hi), f in zip(runs, f_rows):
        col = self._result(f, "rows")[:, L.REF_END]
        ends.append(col if lo > 0 else np.concatenate([[0], col]))
      if any((e < 0).any() or (np.diff(e) < 0).any() or e[-1] > commit.refs for e in ends):
        raise CorruptUnitError(self.unit, "image-ref ends of rows are inconsistent")
      with ts.Batch() as batch:
        f_refs = [self._read("image_refs", int(e[0]), int(e[-1]), batch) if e[-1] > e[0]
                  else None for e in ends]
      self.refresh_images(commit)
      for (lo, hi), e, f in zip(runs, ends, f_refs):
        refs = self._result(f, "image_refs") if f is not None else np.zeros(0, np.int64)
        if (refs < self._live_images).any() or (refs >= self._image_end()).any():
          raise CorruptUnitError(self.unit, "image references point outside the image table")
        for r in range(lo, hi):
          self._row_refs[r] = refs[e[r - lo] - e[0]:e[r - lo + 1] - e[0]]
    return {r: self._row_refs[r] for r in rows}


class _Ready:
  """A read done at once, with the interface of the TensorStore future it replaces."""

  def __init__(self, value=None, error: Exception | None = None):
    self._value, self._error = value, error

  def done(self) -> bool:
    return True

  def result(self):
    if self._error is not None:
      raise self._error
    return self._value


class _Planes:
  """Whole chunks of `sequences` read through TensorStore, split into planes."""

  def __init__(self, future: ts.Future, chunk: int, lo: int, hi: int):
    self._future, self._chunk, self._lo, self._hi = future, chunk, lo, hi

  def done(self) -> bool:
    return self._future.done()

  def result(self):
    c = self._chunk
    chunks = self._future.result().reshape(-1, L.SEQ_BYTES * c)
    return tuple(np.ascontiguousarray(chunks[:, o:o + c * dt.itemsize]).view(dt).reshape(-1)
                 [self._lo:self._hi] for o, (_, dt) in zip(L.seq_plane_offsets(c), L.SEQ_FIELDS))
