"""Retention: a unit's trained rows reclaimed once a durable checkpoint covers them.

Two records beside a unit's commit marker, each one key (RETAIN_LEN int64s and
their crc32c), replaced whole as the marker is, so a reader sees the old or the new:

  retain     the unit's low watermark W, written by the controller only
             (`publish_watermark`): every row below W belongs to a group that is
             retired (trained or dropped) and a durable checkpoint records it, so a
             resumed run lists the unit from W or later and never reads below it.
             W only grows.
  reclaimed  written by the unit's writer only: the extents below which it has
             reclaimed each array (`Floors`), then the extents before its last
             reclamation, so a writer killed while deleting finishes on reopening.

The writer reclaims (UnitWriter.reclaim, between appends): it reads W, works out
what rows >= W still need (their tokens, image refs and turns; row W - 1, whose end
offsets give row W's starts; every image a row >= W refers to, and the index row
before the first of them, whose end gives that image's start), writes `reclaimed`,
then deletes every chunk wholly below those extents. Only the writer deletes, so
its image index (which image ids a new row may refer to without storing them
again) drops the reclaimed images in the same step, and a new row never refers to
an image that is gone. On a local file store written directly, the large chunk files
(`sequences`, `images/data`) go to the array's free pool for the next chunk the
writer writes (chunk_pool.release), so a run in steady state writes into pages the
file system already holds; other chunks, and every chunk of other kvstores, are
deleted.

Readers: a row below W is refused with `ReclaimedRowError` (not a
CorruptUnitError: the unit is healthy) naming the unit, the row and W. The check
runs before a read and again after it: W is written before any chunk it allows
to be reclaimed is touched, so a row still at or above W after its bytes were read
was read from chunks nobody had reclaimed (or recycled) yet.

`StoreSchema.retention = 'all'` keeps every row: the writer never reclaims and the
controller publishes nothing, for replay and debugging (scripts/replay_check.py).
"""
from __future__ import annotations

import dataclasses
import os

import google_crc32c
import numpy as np
import tensorstore as ts

from knittrans_jax.storage import chunk_pool, file_chunks
from knittrans_jax.storage import layout as L
from knittrans_jax.storage.errors import CorruptUnitError, StoreError

RETAIN_KEY, RECLAIMED_KEY = "retain", "reclaimed"
RECORD_FORMAT = 1
_RECORD_BYTES = 8 * L.RETAIN_LEN + 4
# Arrays whose chunk files go to the free pool on a direct local store (the rest are
# small and deleted).
RECYCLED = ("sequences", "images/data")


class ReclaimedRowError(StoreError, LookupError):
  """A row below its unit's low watermark was asked for: its bytes were reclaimed."""

  def __init__(self, unit: str, row: int, watermark: int):
    self.unit, self.row, self.watermark = unit, row, watermark
    super().__init__(
        f"storage unit '{unit}': row {row} is below the unit's low watermark {watermark}: rows "
        "below it were trained (or dropped) and recorded in a durable checkpoint, and their "
        "bytes are reclaimed (StoreSchema.retention = 'trained'); a run that reads old rows "
        "needs StoreSchema.retention = 'all'")


@dataclasses.dataclass(frozen=True)
class Floors:
  """What a unit keeps: every element of an array from its floor on (below may be gone).
  `watermark` is the W these were worked out for."""
  watermark: int = 0
  rows: int = 0  # rows (row W - 1 kept: its ends give row W's starts)
  tokens: int = 0  # sequences
  refs: int = 0  # image_refs
  turns: int = 0  # turns
  images: int = 0  # the first image a kept row refers to (index and hash from images - 1)
  image_bytes: int = 0  # images/data: where image `images` starts

  def keep(self) -> dict[str, int]:
    """Each array's first kept element."""
    index = max(self.images - 1, 0)
    return {"sequences": self.tokens, "rows": self.rows, "image_refs": self.refs, "turns": self.turns, "images/data": self.image_bytes,
            "images/index": index, "images/hash": index}


def _encode(values: list[int]) -> bytes:
  out = np.zeros(L.RETAIN_LEN, np.int64)
  out[:len(values)] = values
  raw = out.tobytes()
  return raw + google_crc32c.value(raw).to_bytes(4, "little")


def _decode(unit: str, key: str, raw: bytes | None) -> np.ndarray:
  if raw is None:
    return np.zeros(L.RETAIN_LEN, np.int64)  # never written: nothing reclaimed
  if len(raw) != _RECORD_BYTES or google_crc32c.value(raw[:-4]) != int.from_bytes(raw[-4:],
                                                                                  "little"):
    raise CorruptUnitError(unit, f"its '{key}' record is damaged ({len(raw)} bytes, crc32c "
                           "mismatch or wrong size)")
  values = np.frombuffer(raw[:-4], np.int64)
  if values[0] not in (0, RECORD_FORMAT) or (values < 0).any():
    raise CorruptUnitError(unit, f"its '{key}' record holds {values.tolist()}")
  return values


class Records:
  """The two records of one unit: straight from their files on a `file://` store,
  through its kvstore otherwise."""

  def __init__(self, unit: str, unit_url: str, durable: bool = False):
    self.unit = unit
    self._dir = file_chunks.local_path(unit_url)
    self._kv = None if self._dir is not None else L.open_kvstore(unit_url, L.context(durable))

  def read(self, key: str) -> np.ndarray:
    if self._dir is not None:
      try:
        with open(self._dir + key, "rb") as f:
          raw = f.read(_RECORD_BYTES + 1)
      except FileNotFoundError:
        raw = None
    else:
      found = self._kv.read(key).result()
      raw = found.value if found.state == "value" else None
    return _decode(self.unit, key, raw)

  def write(self, key: str, values: list[int]) -> None:
    raw = _encode(values)
    if self._dir is not None:
      # Whole and atomic, like the commit marker's file (file_chunks.replace).
      file_chunks.replace(self._dir + key, np.frombuffer(raw, np.uint8), checksum=False)
    else:
      self._kv.write(key, raw).result()

  def watermark(self) -> int:
    return int(self.read(RETAIN_KEY)[1])

  def floors(self) -> tuple[Floors, Floors]:
    """(the floors of the last reclamation, those before it)."""
    v = self.read(RECLAIMED_KEY).tolist()
    return Floors(*v[1:8]), Floors(*v[8:15])


def publish_watermark(unit: str, unit_url: str, row: int, committed: int,
                      durable: bool = False) -> int:
  """(the controller) Raises unit's low watermark to `row` (never lowers it); returns
  the watermark now. Call it only once a durable checkpoint records every row below
  `row` as retired; `committed` (the unit's committed rows) bounds it."""
  if not isinstance(row, (int, np.integer)) or row < 0:
    raise ValueError(f"watermark of unit '{unit}': row must be an int >= 0, got {row!r}")
  if row > committed:
    raise ValueError(f"watermark of unit '{unit}': row {row} is beyond its {committed} "
                     "committed rows")
  records = Records(unit, unit_url, durable)
  now = records.watermark()
  if row > now:
    records.write(RETAIN_KEY, [RECORD_FORMAT, int(row)])
    return int(row)
  return now


def chunk_geometry(name: str, array: ts.TensorStore) -> tuple[int, int]:
  """(elements per chunk along axis 0, in tokens for `sequences`; ndim) of an array."""
  rows = array.chunk_layout.write_chunk.shape[0]
  return (rows // L.SEQ_BYTES if name == "sequences" else rows), array.rank


def chunk_key(name: str, k: int, ndim: int) -> str:
  """The kvstore key of chunk k of an array (the default key encoding)."""
  return f"{name}/c/{k}" + "/0" * (ndim - 1)


class Reclaimer:
  """The writer's side: works out new floors and deletes (or recycles) chunks."""

  def __init__(self, unit: str, unit_url: str, arrays: dict[str, ts.TensorStore],
               durable: bool, direct: bool):
    """`direct`: the writer writes this local unit's chunk files itself, so it takes
    recycled files from the free pools (chunk_pool.release)."""
    self.unit, self._arrays = unit, arrays
    self.records = Records(unit, unit_url, durable)
    self._dir = file_chunks.local_path(unit_url)
    self._kv = None if self._dir is not None else L.open_kvstore(unit_url, L.context(durable))
    self._recycle = direct
    self.floors, prev = self.records.floors()
    if prev != self.floors:  # killed while deleting: finish it
      self._delete(prev, self.floors)
      self._done()

  def _delete(self, old: Floors, new: Floors) -> int:
    """Deletes every chunk below `new`'s floors and at or above `old`'s; returns how many."""
    futures, done = [], 0
    lo, hi = old.keep(), new.keep()
    for name in hi:
      if name not in self._arrays:
        continue
      c, ndim = chunk_geometry(name, self._arrays[name])
      for k in range(lo[name] // c, hi[name] // c):
        if self._dir is not None:
          array_dir = self._dir + name
          done += chunk_pool.release(array_dir, file_chunks.chunk_path(array_dir, k, ndim),
                                      self._recycle and name in RECYCLED)
        else:
          key = chunk_key(name, k, ndim)
          futures.append(self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")))
    for f in futures:
      f.result()
    return done + len(futures)

  def plan(self, watermark: int, rows_committed: int, refs_committed: int,
           images_committed: int, image_bytes_committed: int) -> Floors:
    """The floors for `watermark`: what rows >= watermark still need."""
    W = watermark
    if W <= self.floors.watermark:
      return self.floors
    if W > rows_committed:
      raise CorruptUnitError(self.unit, f"its low watermark {W} is beyond its {rows_committed} "
                             "committed rows")
    prev = self._arrays["rows"][W - 1].read().result()
    tokens, refs = int(prev[L.TOK_END]), int(prev[L.REF_END])
    turns = int(prev[L.TURN_END]) if prev.size > L.TURN_END else 0
    live = (self._arrays["image_refs"][refs:refs_committed].read().result()
            if refs_committed > refs else np.zeros(0, np.int64))
    images = int(live.min()) if live.size else images_committed
    image_bytes = (image_bytes_committed if images == images_committed else
                   int(self._arrays["images/index"][images - 1].read().result()[L.IMG_BYTE_END])
                   if images else 0)
    new = Floors(W, W - 1, tokens, refs, turns, images, image_bytes)
    # Never below what is already reclaimed (every field only grows).
    return Floors(*np.maximum(dataclasses.astuple(new), dataclasses.astuple(self.floors)).tolist())

  def apply(self, new: Floors) -> int:
    """Records `new`, then deletes what it frees; returns the chunks deleted."""
    if new == self.floors:
      return 0
    old = self.floors
    self.records.write(RECLAIMED_KEY, [RECORD_FORMAT, *dataclasses.astuple(new),
                                       *dataclasses.astuple(old)])
    self.floors = new
    done = self._delete(old, new)
    self._done()
    return done

  def drop_pools(self) -> int:
    """Deletes the free pools' files (the writer appends no more); returns how many."""
    if self._dir is None:
      return 0
    return sum(chunk_pool.drop_pool(self._dir + name) for name in RECYCLED)

  def _done(self) -> None:
    """Every deletion of the last reclamation is done: a reopened writer has none left."""
    now = dataclasses.astuple(self.floors)
    self.records.write(RECLAIMED_KEY, [RECORD_FORMAT, *now, *now])


def unit_bytes(unit_url: str) -> int:
  """Bytes of a local unit's files, free pools included (a store's footprint)."""
  root = file_chunks.local_path(unit_url)
  if root is None:
    raise ValueError(f"unit_bytes: {unit_url} is not a file:// unit")
  total = 0
  for d, _, files in os.walk(root):
    for f in files:
      try:
        total += os.stat(os.path.join(d, f)).st_blocks * 512
      except FileNotFoundError:
        pass
  return total
