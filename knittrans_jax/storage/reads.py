"""Asynchronous, batched payload reads for a list of trajectories.

Consecutive rows of a unit are coalesced into one range read of its sequences (a
whole unit read is one read); all reads go out in one `ts.Batch` so the kvstore can
overlap them. `.result()` waits, checks what came back, and slices. Sequence and
image bytes of local (file://) units are read straight from their chunk files
instead, when the read is issued (UnitReader.read_sequences and .read_flat,
storage/file_chunks.py).

Every image read is checked against its id, the content hash the writer stored
(xxh3-128, cheaper than the read itself: docs/storage.md): a damaged, missing or swapped
image is an error naming its unit, id and image-table row. With dedup an image is
read once per call; without (StoreSchema.dedup_images=False) each trajectory's own
copy is read and checked, and the payload holds one array per id either way.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Collection, Sequence

import numpy as np
import tensorstore as ts

from knittrans_jax.storage import layout as L
from knittrans_jax.storage.errors import CorruptUnitError
from knittrans_jax.storage.unit_reader import UnitReader
from knittrans_jax.types import Payload, TrajMeta

_SEQ_ARRAYS = tuple(name for name, _ in L.SEQ_FIELDS)


def _runs(units: list[str], starts: list[int], ends: list[int]) -> list[list[int]]:
  """Indices grouped into runs of contiguous token ranges, sorted by unit and offset."""
  n = len(units)
  if n and units.count(units[0]) == n and starts[1:] == ends[:-1]:
    return [list(range(n))]  # rows as stored (a sequential read): one run, no sort
  runs: list[list[int]] = []
  prev_unit, prev_end = None, -1
  for i in sorted(range(n), key=list(zip(units, starts)).__getitem__):
    if units[i] == prev_unit and starts[i] == prev_end:
      runs[-1].append(i)
    else:
      runs.append([i])
    prev_unit, prev_end = units[i], ends[i]
  return runs


@dataclasses.dataclass
class _ImageRead:
  """One image copy to read and check."""
  id: str
  unit: str
  table_row: int
  row: int | None  # the trajectory whose own copy this is (no-dedup stores)
  reader: UnitReader
  future: ts.Future | None = None

  def where(self) -> str:
    whose = f", the copy of trajectory row {self.row}" if self.row is not None else ""
    return f"image {self.id} (image table row {self.table_row}{whose})"


def _image_reads(metas: Sequence[TrajMeta], reader_of: Callable[[str], UnitReader],
                 skip: Collection[str], dedup: bool) -> list[_ImageRead]:
  """The image copies a read needs, in the order their trajectories were asked for."""
  out: list[_ImageRead] = []
  if dedup:  # each image once, however many trajectories share it
    seen = set(skip)
    for m in metas:
      for iid in m.image_ids:
        if iid not in seen:
          seen.add(iid)
          reader = reader_of(m.unit)
          try:
            out.append(_ImageRead(iid, m.unit, reader.image_row(iid), None, reader))
          except KeyError as e:
            raise CorruptUnitError(m.unit, str(e)) from e
    return out
  rows: dict[str, list[int]] = {}
  for m in metas:
    if any(iid not in skip for iid in m.image_ids):
      rows.setdefault(m.unit, []).append(m.row)
  refs = {unit: reader_of(unit).row_image_refs(rs) for unit, rs in rows.items()}
  for m in metas:
    if m.row not in refs.get(m.unit, {}):
      continue
    reader, own = reader_of(m.unit), refs[m.unit][m.row]
    if len(own) != len(m.image_ids):
      raise CorruptUnitError(m.unit, f"trajectory row {m.row} refers to {len(own)} images; its "
                             f"record names {len(m.image_ids)}")
    for iid, k in zip(m.image_ids, own.tolist()):
      if iid in skip:
        continue
      if reader.image_id_at(k) != iid:
        raise CorruptUnitError(m.unit, f"trajectory row {m.row} refers to image table row {k}, "
                               f"which holds image {reader.image_id_at(k)}, not {iid}")
      out.append(_ImageRead(iid, m.unit, k, m.row, reader))
  return out


class ReadFuture:
  """Reads in flight; `result()` returns a `Payload` in the order asked for."""

  def __init__(self, metas: Sequence[TrajMeta], reader_of: Callable[[str], UnitReader],
               skip_images: Collection[str] = (), dedup_images: bool = True):
    self._metas = list(metas)
    # Plain lists, read once: a whole-unit read has thousands of trajectories.
    fields = lambda name: list(map(operator.attrgetter(name), self._metas))  # loops in C
    units, self._starts = fields("unit"), fields("token_start")
    self._ends = list(map(operator.add, self._starts,
                          map(operator.add, fields("prompt_len"), fields("response_len"))))
    self._runs = _runs(units, self._starts, self._ends)
    self._futures = []  # (unit, run, future of the run's sequences)
    # Each unit's lowest row, checked against its low watermark before and after the
    # read (storage/retention.py): never a reclaimed row's, or a recycled chunk's, bytes.
    self._lowest = {}
    for unit, row in zip(units, fields("row")):
      if row < self._lowest.get(unit, row + 1):
        self._lowest[unit] = row
    self._reader_of = reader_of
    self._check_reclaimed()
    # Located first: locating may read metadata (image table, a no-dedup row's refs).
    self._images = (_image_reads(self._metas, reader_of, skip_images, dedup_images)
                    if any(fields("image_ids")) else [])
    with ts.Batch() as batch:
      for run in self._runs:
        unit = units[run[0]]
        reader = reader_of(unit)
        self._futures.append((unit, run, reader.read_sequences(
            self._starts[run[0]], self._ends[run[-1]], batch)))
      for img in self._images:
        start, end, _, _ = img.reader.image_at(img.table_row)
        # The content hash checks every image read: its chunks' crc32c is not needed.
        img.future = img.reader.read_flat("images/data", start, end, batch, checked_elsewhere=True)

  def _check_reclaimed(self) -> None:
    for unit, row in self._lowest.items():
      self._reader_of(unit).check_rows(row)

  def done(self) -> bool:
    return all(f.done() for _, _, f in self._futures) and all(
        img.future.done() for img in self._images)

  def result(self) -> Payload:
    try:
      payload = self._result()
    except CorruptUnitError:
      self._check_reclaimed()  # a row reclaimed while it was read, not a damaged unit
      raise
    self._check_reclaimed()
    return payload

  def _result(self) -> Payload:
    n = len(self._metas)
    out = {name: [None] * n for name in _SEQ_ARRAYS}
    for unit, run, fut in self._futures:
      try:
        arrays = dict(zip(_SEQ_ARRAYS, fut.result()))
      except Exception as e:
        raise CorruptUnitError(unit, f"reading the sequences failed: {e}") from e
      # Fill values mark chunks that are missing inside the committed range (through
      # TensorStore), and values no writer stores mark damaged ones (a chunk's head
      # overwritten, faults/corrupt_chunk.py).
      if L.sequences_damaged(*arrays.values()):
        raise CorruptUnitError(unit, "payload chunk missing inside the committed range "
                               f"(rows {self._metas[run[0]].row}..{self._metas[run[-1]].row})")
      arrays["loss_mask"] = arrays["loss_mask"].view(np.bool_)
      whole = len(run) == n and run == list(range(n))  # one run, in the order asked
      starts, ends = ((self._starts, self._ends) if whole else
                      ([self._starts[i] for i in run], [self._ends[i] for i in run]))
      if starts[0]:  # offsets within the run's buffer
        starts, ends = (np.subtract(x, starts[0]).tolist() for x in (starts, ends))
      cuts = list(map(slice, starts, ends))
      for name, arr in arrays.items():  # views into the run's buffer, no copies
        views = list(map(arr.__getitem__, cuts))
        if whole:
          out[name] = views
          continue
        dst = out[name]
        for i, v in zip(run, views):
          dst[i] = v
    images, image_bytes = {}, 0
    for img in self._images:
      try:
        raw = img.future.result()
      except Exception as e:
        raise CorruptUnitError(img.unit, f"reading {img.where()} failed: {e}") from e
      _, _, dtype, shape = img.reader.image_at(img.table_row)
      image = raw.view(dtype).reshape(shape)
      # The id is the hash of dtype, shape and bytes: catches damaged or missing image
      # chunks, damaged hashes, and another image's bytes in this one's place.
      if img.reader.image_hash(image) != img.id:
        raise CorruptUnitError(img.unit, f"{img.where()} does not match its content hash: its "
                               "bytes are damaged, missing, or another image's")
      images.setdefault(img.id, image)
      image_bytes += raw.nbytes
    return Payload(metas=self._metas, tokens=out["tokens"], logprobs=out["logprobs"],
                   loss_mask=out["loss_mask"], images=images, image_bytes_read=image_bytes)
