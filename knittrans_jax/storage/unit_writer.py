"""Appends trajectories to one storage unit; one producer per unit.

An append writes every payload and column beyond the committed extents, waits for
all of it, and only then writes the commit marker. A crash before that leaves the
data invisible (and overwritten by the next append); a crash after it leaves a
complete row. Nothing of an earlier commit is ever rewritten except the unchanged
bytes of a partially filled chunk, which kvstores replace atomically. Every chunk is
written whole, from the committed bytes the writer keeps (storage/whole_chunks.py).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import time
from typing import Sequence

import numpy as np

from knittrans_jax.storage import file_chunks
from knittrans_jax.storage import layout as L
from knittrans_jax.storage.commit import Commit, read_commit, write_commit
from knittrans_jax.storage.errors import CorruptUnitError, StoreError
from knittrans_jax.storage.images import (Image, check_image, hash_to_hex, hex_to_hash,
                                          image_id)
from knittrans_jax.storage.retention import Reclaimer
from knittrans_jax.storage.schema import StoreSchema
from knittrans_jax.storage.validation import pack_append
from knittrans_jax.storage.whole_chunks import DamagedTail, WholeChunkAppender
from knittrans_jax.types import TrajMeta, Trajectory


# How often an append looks for a new low watermark (one small read).
RECLAIM_CHECK_S = 1.0


class UnitWriter:
  """The single writer of a storage unit. Reopening after a crash resumes at the commit."""

  def __init__(self, root: str, unit: str, schema: StoreSchema, host: str | None = None,
               registered: bool = False, reclaim_every_s: float = RECLAIM_CHECK_S):
    """`reclaim_every_s`: how often an append first looks for a new low watermark."""
    self.unit = L.check_unit_name(unit)
    self._reclaim_every_s = reclaim_every_s
    self.schema = schema
    self.url = L.join(root, unit)
    marker = L.open_unit_arrays(self.url, schema, create=True, names=("commit",))
    self._commit = read_commit(unit, marker["commit"], allow_missing=not registered)
    # Opened only now: a unit of an older format was refused by its marker above
    # (read_commit names its format), before it could get this format's arrays.
    names = set(L.unit_arrays(self.url, schema)) - {"commit"}
    self._arrays = {**marker, **L.open_unit_arrays(self.url, schema, create=True, names=names)}
    if not registered and self._commit == Commit():
      write_commit(self._arrays["commit"], Commit())  # marks a valid, empty unit
    self.host = host or socket.gethostname()
    info = {"unit": unit, "host": self.host, "pid": os.getpid(), "opened_unix": time.time()}
    kv = L.open_kvstore(self.url, L.context(schema.durable))
    kv.write("unit.json", json.dumps(info)).result()
    # A local unit is written straight to its chunk files (storage/file_chunks.py),
    # except with `durable`, where TensorStore's file driver does the fsyncs.
    self._dir = None if schema.durable else file_chunks.local_path(self.url)
    self._in_place = self._dir is not None and file_chunks.local_file_system(self._dir)
    # Retention (storage/retention.py): finishes a reclamation a killed writer left.
    self._reclaimer = Reclaimer(unit, self.url, self._arrays, schema.durable,
                                direct=self._dir is not None)
    self._reclaim_checked = 0.0
    self._load_committed()
    self._unsure = False  # a commit marker write failed: did it land? (see _write)

  def _load_committed(self) -> None:
    """The image index and the committed chunk tails, from the commit marker."""
    c = self._commit
    try:
      self._chunks = WholeChunkAppender(self._arrays, {
          "sequences": c.tokens, "rows": c.rows, "image_refs": c.refs,
          "images/data": c.image_bytes, "images/index": c.images, "images/hash": c.images,
          "turns": c.turns},
          self._dir, self._in_place)
    except DamagedTail as e:
      raise CorruptUnitError(self.unit, str(e)) from e
    self._image_index: dict[str, int] = {}
    first = self._reclaimer.floors.images  # images below it are reclaimed
    if self._commit.images > first:
      hashes = self._arrays["images/hash"][first:self._commit.images].read().result()
      self._image_index = {hash_to_hex(h): first + i for i, h in enumerate(hashes)}

  def _resync(self) -> None:
    """After an append whose outcome is unknown: continue from what the store holds."""
    if self._unsure:
      try:
        self._commit = read_commit(self.unit, self._arrays["commit"])
        self._load_committed()
      except Exception as e:
        raise StoreError(f"unit '{self.unit}': cannot re-read the commit marker after a failed "
                         f"append: {e}") from e
      self._unsure = False

  def reclaim(self) -> int:
    """Reclaims the rows below the unit's low watermark (storage/retention.py): the
    chunks wholly below what rows at or above it need, and the images none of them
    refers to. Returns the chunks reclaimed. A no-op with StoreSchema.retention 'all'."""
    self._reclaim_checked = time.monotonic()
    if self.schema.retention == "all":
      return 0
    self._resync()
    r, c = self._reclaimer, self._commit
    watermark = r.records.watermark()
    if watermark <= r.floors.watermark:
      return 0
    done = r.apply(r.plan(watermark, c.rows, c.refs, c.images, c.image_bytes))
    first = r.floors.images
    self._image_index = {iid: k for iid, k in self._image_index.items() if k >= first}
    return done

  def drop_free_pools(self) -> int:
    """Deletes the chunk files kept for reuse (the writer will append no more: the end
    of a run); a later writer makes new files. Returns how many."""
    return self._reclaimer.drop_pools()

  @property
  def num_rows(self) -> int:
    return self._commit.rows

  @property
  def commit(self) -> Commit:
    return self._commit

  def append(self, trajectories: Sequence[Trajectory],
             images: Sequence[Image | np.ndarray] = ()) -> list[TrajMeta]:
    """Atomically appends trajectories (and new images) and returns their metadata.

    `images` are `Image`s (id made once, by the caller, and trusted here) or bare
    arrays (hashed here). With `StoreSchema.dedup_images` an image is stored once:
    one already in the unit is skipped, and a trajectory's image_ids may name an
    image of the unit or of `images`. Without, every image reference of every
    trajectory gets its own copy, so its images must come in this call.
    """
    self._resync()
    if time.monotonic() - self._reclaim_checked >= self._reclaim_every_s:
      self.reclaim()
    ids, pool = self._resolve_images(images)
    dedup = self.schema.dedup_images
    packed = None
    if trajectories:
      # Ids a trajectory may name: looked up in place (a union would copy the
      # unit's whole image index on every append).
      known = (pool if not dedup or not self._image_index else self._image_index if not pool
               else _Either(self._image_index, pool))
      packed = pack_append(trajectories, self.schema, known, out=functools.partial(
          self._chunks.reserve_sequences, self._commit.tokens))
    if dedup:
      new = [(iid, im) for iid, im in pool.items() if iid not in self._image_index]
    else:  # a copy per reference, in reference order
      refs = packed.image_ids if packed is not None else []
      new = [(iid, pool[iid]) for row in refs for iid in row]
    return self._write(packed, new)

  def _resolve_images(self, images) -> tuple[list[str], dict[str, np.ndarray]]:
    """Each image's id, in order, and the arrays to store by id (validated).

    An `Image` brings its id and is not hashed. A bare array is hashed, once per
    array object of the call (a producer passing one array 8 times hashes it once).
    """
    ids, pool, hashed = [], {}, {}
    for k, image in enumerate(images):
      where = f"unit '{self.unit}' image {k}"
      if isinstance(image, Image):
        iid = _check_id(image.id, where)
        if iid not in pool and not (self.schema.dedup_images and iid in self._image_index):
          pool[iid] = check_image(image.array, where)
      elif id(image) in hashed:
        iid = hashed[id(image)]
      else:
        array = check_image(image, where)
        iid = hashed[id(image)] = image_id(array)
        pool.setdefault(iid, array)
      ids.append(iid)
    return ids, pool

  def _write(self, packed, new_images: list[tuple[str, np.ndarray]]) -> list[TrajMeta]:
    c, write = self._commit, self._chunks.write
    self._chunks.discard()  # nothing pending from an append that raised before its writes
    futures = []
    n_img, img_bytes = c.images, c.image_bytes
    index = self._image_index
    if new_images:
      index = dict(index)  # the committed index stays as it is if this append fails
      blobs = [im.reshape(-1).view(np.uint8) for _, im in new_images]
      ends = img_bytes + np.cumsum([b.size for b in blobs])
      rows = np.zeros((len(blobs), L.IMG_COLS), np.int64)
      rows[:, L.IMG_BYTE_END] = ends
      for k, (iid, im) in enumerate(new_images):
        rows[k, L.IMG_DTYPE] = L.IMAGE_DTYPES.index(im.dtype)
        rows[k, L.IMG_NDIM] = im.ndim
        rows[k, L.IMG_DIM0:L.IMG_DIM0 + im.ndim] = im.shape
        index[iid] = n_img + k  # without dedup: the newest copy
      hashes = np.stack([hex_to_hash(iid) for iid, _ in new_images])
      futures += [self._chunks.write_bytes("images/data", img_bytes, blobs),
                  write("images/index", n_img, rows), write("images/hash", n_img, hashes)]
      n_img, img_bytes = n_img + len(blobs), int(ends[-1])

    metas, n_rows, n_tok, n_refs, n_turns = [], c.rows, c.tokens, c.refs, c.turns
    if packed is not None:
      cols = packed.cols  # the rows' columns; the three end offsets are filled in here
      k, T = cols.shape[1], packed.tokens.size
      lengths = cols[L.PROMPT_LEN] + cols[L.RESPONSE_LEN]
      tok_end = cols[L.TOK_END]
      np.cumsum(lengths, out=tok_end)
      tok_end += c.tokens
      if self.schema.dedup_images:
        refs = np.asarray([index[i] for ids in packed.image_ids for i in ids], np.int64)
      else:  # the copies were written in reference order
        refs = np.arange(c.images, n_img, dtype=np.int64)
      cols[L.REF_END] = c.refs
      if refs.size:
        cols[L.REF_END] += np.cumsum(list(map(len, packed.image_ids)))
      turn_end = cols[L.TURN_END]
      np.cumsum(packed.turn_count, out=turn_end)
      turn_end += c.turns
      planes = (packed.tokens, packed.logprobs, packed.loss_mask)
      futures += [self._chunks.write_sequences(c.tokens, planes),
                  write("rows", c.rows, cols.T)]  # the reward among its columns
      if refs.size:
        futures.append(write("image_refs", c.refs, refs))
      if packed.turns.size:
        futures.append(write("turns", c.turns, packed.turns))
      spans = (L.turn_spans(packed.turns, turn_end - packed.turn_count - c.turns,
                            packed.turn_count) if packed.turns.size else [()] * k)
      metas = _metas(self.unit, c.rows, self.schema.sources, tok_end - lengths, cols,
                     packed.reward, packed.image_ids, spans)
      n_rows, n_tok, n_refs = c.rows + k, c.tokens + T, c.refs + refs.size
      n_turns = c.turns + len(packed.turns)
    if not futures:
      return metas
    errors = []
    for f in futures:  # wait for all: none may land after a later append's commit
      try:
        f.result()
      except Exception as e:
        errors.append(e)
    if errors:
      raise StoreError(f"append to unit '{self.unit}' failed; nothing of it was committed "
                       f"(unit still at {c.rows} rows): {errors[0]}") from errors[0]
    new = Commit(rows=n_rows, tokens=n_tok, refs=n_refs, images=n_img, image_bytes=img_bytes,
                 turns=n_turns)
    try:
      # last: this makes the rows visible
      write_commit(self._arrays["commit"], new, self._dir, self._in_place)
    except Exception as e:
      # On a remote store the marker may have landed with only its answer lost, or
      # land later from a request still in flight: ask now, and ask again before the
      # next append (which must continue from what readers may have seen).
      self._unsure = True
      try:
        landed = read_commit(self.unit, self._arrays["commit"]) == new
      except Exception:
        raise StoreError(f"append to unit '{self.unit}' failed writing its commit marker and the "
                         f"marker cannot be read back: all of the append or none of it was "
                         f"committed (the unit was at {c.rows} rows; the writer re-reads the "
                         f"marker before its next append): {e}") from e
      if not landed:
        raise StoreError(f"append to unit '{self.unit}' failed; nothing of it was committed "
                         f"(unit still at {c.rows} rows): {e}") from e
      self._unsure = False  # it holds this append's marker: the append succeeded
    self._chunks.commit()
    self._commit, self._image_index = new, index
    return metas


class _Either:
  """The ids of two image indexes, looked up in each (`in` is all validation asks)."""

  def __init__(self, a, b):
    self._a, self._b = a, b

  def __contains__(self, iid) -> bool:
    return iid in self._a or iid in self._b


# TrajMeta's fields, as _metas sets them (checked at import, so a new field fails
# here rather than leave records without it).
_META_FIELDS = ("unit", "row", "token_start", "prompt_len", "response_len", "source",
                "group_id", "index_in_group", "version_first", "version_last", "reward",
                "image_ids", "loss_tokens", "turns", "gen_seconds", "env_seconds")
assert _META_FIELDS == tuple(f.name for f in dataclasses.fields(TrajMeta))
assert not hasattr(TrajMeta, "__post_init__") and not hasattr(TrajMeta, "__slots__")


def _metas(unit: str, first_row: int, sources, starts: np.ndarray, cols: np.ndarray,
           reward: np.ndarray, image_ids, turns) -> list[TrajMeta]:
  """The appended rows' records. Made as TrajMeta's __init__ would (it only sets the
  fields: asserted above) but with their dict set at once: a frozen dataclass sets
  each field through object.__setattr__, 2.5 us a record against 0.8 here."""
  c = cols.tolist()  # one conversion per column, not per value
  timed = cols[[L.GEN_US, L.ENV_US]]
  us = (timed / 1e6).tolist() if timed.any() else [[0.0] * len(starts)] * 2
  out, new = [], object.__new__
  for row, start, plen, rlen, src, gid, idx, v0, v1, rew, ids, loss, spans, gen, env in zip(
      range(first_row, first_row + len(starts)), starts.tolist(), c[L.PROMPT_LEN],
      c[L.RESPONSE_LEN], c[L.SOURCE], c[L.GROUP_ID], c[L.INDEX_IN_GROUP], c[L.V_FIRST],
      c[L.V_LAST], reward.tolist(), image_ids, c[L.LOSS_TOKENS], turns, us[0], us[1]):
    meta = new(TrajMeta)
    meta.__dict__.update(
        unit=unit, row=row, token_start=start, prompt_len=plen, response_len=rlen,
        source=sources[src], group_id=gid, index_in_group=idx, version_first=v0,
        version_last=v1, reward=rew, image_ids=ids, loss_tokens=loss, turns=spans,
        gen_seconds=gen, env_seconds=env)
    out.append(meta)
  return out


def _check_id(iid, where: str) -> str:
  if not isinstance(iid, str) or len(iid) != 2 * L.HASH_BYTES or iid.strip("0123456789abcdef"):
    raise ValueError(f"{where}: Image.id {iid!r} is not a {2 * L.HASH_BYTES}-digit lowercase hex "
                     "hash (make Images with Image.of)")
  return iid
