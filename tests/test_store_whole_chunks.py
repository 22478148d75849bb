"""Appends write whole chunks from the committed tails the writer keeps
(storage/whole_chunks.py): resumed writers and failed appends keep every byte."""
import dataclasses

import numpy as np
import pytest
import tensorstore as ts
from store_helpers import SOURCES, check_payload, group

from knittrans_jax.storage import Image, StoreError, StoreSchema, TrajectoryStore
from knittrans_jax.storage import file_chunks
from knittrans_jax.storage import layout as L

SEED, N = 9, 3
# Small chunks, so that appends straddle chunks of every array.
SCHEMA = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=64, row_chunk=4,
                     image_chunk_bytes=100)


class _FailingWrites:
  """An array whose writes fail (after a real round trip to the store)."""

  def __init__(self, array):
    self.array = array

  def __getitem__(self, index):
    array = self.array

    class _Slice:
      def write(self, data):
        array[index].read().result()
        promise, future = ts.Promise.new()
        promise.set_exception(OSError("injected write failure"))
        return future
    return _Slice()


@pytest.mark.parametrize("durable", [False, True])  # direct chunk-file writes; TensorStore's
def test_resumed_writers_and_a_failed_append_keep_every_committed_byte(tmp_path, monkeypatch,
                                                                        durable):
  store = TrajectoryStore.create(f"file://{tmp_path}/s", dataclasses.replace(SCHEMA,
                                                                            durable=durable))
  real_replace = file_chunks.replace

  def failing_rows(path, *args, **kw):
    if "/rows/" in path:
      raise OSError("injected write failure")
    return real_replace(path, *args, **kw)
  rng = np.random.default_rng(SEED)
  images = [Image.of(rng.integers(0, 255, (7, 9), dtype=np.uint8)) for _ in range(7)]
  w = store.writer("u")
  for gid in range(12):
    if gid in (4, 9):  # a new writer resumes mid-chunk from what is on the store
      w = store.writer("u")
    if gid == 7:  # a failed append, after its other writes: nothing of it commits
      real = w._arrays["rows"]
      w._arrays["rows"] = _FailingWrites(real)
      monkeypatch.setattr(file_chunks, "replace", failing_rows)
      with pytest.raises(StoreError, match="injected write failure"):
        w.append([dataclasses.replace(t, image_ids=(images[6].id,)) for t in group(SEED, 99, N)],
                 images=[images[6]])
      w._arrays["rows"] = real
      monkeypatch.setattr(file_chunks, "replace", real_replace)
    image = images[gid // 2]
    w.append([dataclasses.replace(t, image_ids=(image.id,)) for t in group(SEED, gid, N)],
             images=[image])
  fresh = TrajectoryStore.open(store.url)
  metas = fresh.list_committed("u")
  assert [m.group_id for m in metas] == [g for g in range(12) for _ in range(N)]
  payload = fresh.read(metas).result()
  check_payload(payload, SEED, N)
  assert list(payload.images) == [im.id for im in images[:6]]
  for im in images[:6]:
    np.testing.assert_array_equal(payload.images[im.id], im.array)
  commit = fresh.reader("u").commit()
  assert commit.images == 6 and commit.rows == 12 * N
  # Past the committed extent, the last chunks hold fill values (later appends wrote
  # over the failed one's bytes).
  arrays = fresh.reader("u").arrays
  k, j = divmod(commit.tokens, 64)
  assert j, "the test wants a partly filled last chunk"
  last = arrays["sequences"][k * 64 * L.SEQ_BYTES:(k + 1) * 64 * L.SEQ_BYTES].read().result()
  for o, (_, dt) in zip(L.seq_plane_offsets(64), L.SEQ_FIELDS):  # each plane's end
    assert (last[o + j * dt.itemsize:o + 64 * dt.itemsize] == L.SEQ_FILL).all()
  assert (arrays["rows"][commit.rows:-(-commit.rows // 4) * 4].read().result() == L.ROWS_FILL).all()


@pytest.mark.parametrize("checksum,exchange,local", [
    (False, True, True), (True, True, True), (False, False, True), (False, True, False)])
def test_direct_writes_equal_tensorstore_writes(tmp_path, monkeypatch, checksum, exchange, local):
  """A local unit's chunk files, written directly (in place for `sequences` without
  crc32c on a local file system, else replaced whole; replaced by exchanging names,
  or by plain renames where the kernel cannot exchange), hold the bytes TensorStore's
  writes (durable: its file driver) leave."""
  import os
  exchanges, renameat2 = [], file_chunks._RENAMEAT2
  if exchange and renameat2 is None:
    pytest.skip("no renameat2 RENAME_EXCHANGE on this kernel, libc or file system")

  def counted(*args):
    exchanges.append(renameat2(*args))
    return exchanges[-1]
  monkeypatch.setattr(file_chunks, "_RENAMEAT2", counted if exchange else None)
  monkeypatch.setattr(file_chunks, "local_file_system", lambda path: local)
  monkeypatch.setattr(file_chunks, "no_writeback", lambda path: False)  # exchanged on tmpfs too
  rng = np.random.default_rng(SEED)
  images = [Image.of(rng.integers(0, 255, (7, 9), dtype=np.uint8)) for _ in range(6)]
  files = {}
  for durable in (False, True):
    schema = dataclasses.replace(SCHEMA, durable=durable, payload_checksum=checksum)
    root = tmp_path / f"durable{durable}"
    w = TrajectoryStore.create(f"file://{root}", schema).writer("u")
    for gid in range(12):
      if gid == 5:
        w = TrajectoryStore.open(f"file://{root}").writer("u")  # resumes mid-chunk
      image = images[gid // 2]
      w.append([dataclasses.replace(t, image_ids=(image.id,)) for t in group(SEED, gid, N)],
               images=[image])
    unit = root / "u"
    files[durable] = {os.path.relpath(os.path.join(d, f), unit): open(os.path.join(d, f), "rb").read()
                      for d, _, names in os.walk(unit) for f in names if f != "unit.json"}
  assert sorted(files[False]) == sorted(files[True])
  assert len([k for k in files[True] if k.startswith("sequences/c/")]) > 3
  for key, data in files[True].items():
    assert files[False][key] == data, key

  assert not [k for k in files[False] if "tmp" in k]  # no temporary file is left behind
  if exchange:  # names were exchanged (0), not only renamed
    assert exchanges.count(0) > 10, exchanges[:20]


def test_a_boundary_chunk_file_of_the_wrong_size_is_rewritten_whole(tmp_path):
  """The in-place write needs a whole chunk file; any other is replaced, from the
  committed tail the writer keeps."""
  import os
  store = TrajectoryStore.create(f"file://{tmp_path}/s", SCHEMA)
  w = store.writer("u")
  w.append(group(SEED, 0, N))
  k, j = divmod(w.commit.tokens, 64)
  assert j
  path = tmp_path / "s" / "u" / "sequences" / "c" / str(k)
  with open(path, "ab") as f:
    f.write(b"\0")  # now one byte too long: not a chunk file to write into
  w.append(group(SEED, 1, N))
  assert os.path.getsize(path) == 64 * L.SEQ_BYTES
  fresh = TrajectoryStore.open(store.url)
  check_payload(fresh.read(fresh.list_committed("u")).result(), SEED, N)


def _trajectory(gid: int, length: int):
  """A trajectory of `length` tokens (8 of them prompt), values set by gid."""
  from knittrans_jax.types import Trajectory
  rng = np.random.default_rng(gid)
  r = length - 8
  return Trajectory(prompt_tokens=rng.integers(0, 999, 8, dtype=np.int32),
                    response_tokens=rng.integers(0, 999, r, dtype=np.int32),
                    logprobs=-rng.random(r, dtype=np.float32), loss_mask=rng.random(r) < 0.7,
                    reward=float(gid), source=SOURCES[0], group_id=gid, index_in_group=0,
                    versions=(0,))


def test_appends_at_chunk_edges_and_a_failed_sequences_write(tmp_path, monkeypatch):
  """Appends that exactly fill a chunk, span four, and one whose in-place write of
  `sequences` fails midway, then shorter appends over its bytes and a reopened
  writer: every committed token reads back as written."""
  store = TrajectoryStore.create(f"file://{tmp_path}/s", SCHEMA)  # 64 tokens per chunk
  w = store.writer("u")
  done = []
  for gid, length in ((0, 64), (1, 200)):  # fills chunk 0; spans chunks 1-4
    w.append([_trajectory(gid, length)])
    done.append(gid)
  assert w.commit.tokens == 264
  real_update = file_chunks.update

  def fail_after_one(path, file_bytes, pieces):
    real_update(path, file_bytes, pieces[:1])  # the ids land, then the disk fails
    raise OSError("injected failure mid-write")
  monkeypatch.setattr(file_chunks, "update", fail_after_one)
  with pytest.raises(StoreError, match="injected failure mid-write"):
    w.append([_trajectory(2, 150)])
  monkeypatch.setattr(file_chunks, "update", real_update)
  assert w.commit.tokens == 264
  for gid, length in ((3, 10), (4, 60)):  # over the failed append's bytes
    w.append([_trajectory(gid, length)])
    done.append(gid)
  w = TrajectoryStore.open(store.url).writer("u")  # resumes from the store mid-chunk
  w.append([_trajectory(5, 70)])
  done.append(5)
  fresh = TrajectoryStore.open(store.url)
  metas = fresh.list_committed("u")
  assert [m.group_id for m in metas] == done
  payload = fresh.read(metas).result()
  for m, tok, lp, mask in zip(metas, payload.tokens, payload.logprobs, payload.loss_mask):
    t = _trajectory(m.group_id, m.length)
    np.testing.assert_array_equal(tok, np.concatenate([t.prompt_tokens, t.response_tokens]))
    np.testing.assert_array_equal(lp[8:], t.logprobs)
    np.testing.assert_array_equal(mask[8:], t.loss_mask)


def test_a_missing_boundary_chunk_is_not_appended_over(tmp_path):
  """A writer opening a unit whose last, partly filled chunk is gone refuses it (the
  chunk would read as fill values and be written back as if they were data)."""
  import os

  from knittrans_jax.storage import CorruptUnitError
  store = TrajectoryStore.create(f"file://{tmp_path}/s", SCHEMA)
  store.writer("u").append([_trajectory(0, 100)])  # chunk 1 holds tokens 64..99
  os.remove(tmp_path / "s" / "u" / "sequences" / "c" / "1")
  with pytest.raises(CorruptUnitError, match="'u'.*last chunk of its sequences array"):
    TrajectoryStore.open(store.url).writer("u")


@pytest.mark.parametrize("checksum", [False, True])  # in place; replaced whole
def test_image_copies_are_written_from_their_arrays_across_chunks(tmp_path, monkeypatch,
                                                                   checksum):
  """With a copy per trajectory, an append's image bytes go to the chunk files straight
  from the arrays (whole_chunks.write_bytes; nothing joins them): copies straddling
  100-byte chunks, a writer reopened mid-chunk, a boundary chunk file cut short (then
  replaced whole from the tail) and a failed append all leave every image exact."""
  import os
  schema = dataclasses.replace(SCHEMA, dedup_images=False, payload_checksum=checksum)
  store = TrajectoryStore.create(f"file://{tmp_path}/s", schema)
  rng = np.random.default_rng(SEED)
  images = [Image.of(rng.integers(0, 255, (7, 9 + g), dtype=np.uint8)) for g in range(5)]
  monkeypatch.setattr(np, "concatenate", _no_big_joins(np.concatenate))
  w = store.writer("u")
  for gid in range(5):
    if gid == 2:
      w = TrajectoryStore.open(store.url).writer("u")  # resumes mid-chunk
    if gid == 3:
      k = w.commit.image_bytes // 100
      assert w.commit.image_bytes % 100
      with open(tmp_path / "s" / "u" / "images" / "data" / "c" / str(k), "r+b") as f:
        f.truncate(37)  # not a whole chunk file: the next append replaces it whole
      real_replace = file_chunks.replace
      monkeypatch.setattr(file_chunks, "replace", _fail_on("/images/data/", real_replace))
      with pytest.raises(StoreError, match="injected write failure"):
        w.append([dataclasses.replace(t, image_ids=(images[4].id,)) for t in group(SEED, 99, N)],
                 images=[images[4]])
      monkeypatch.setattr(file_chunks, "replace", real_replace)
    image = images[gid]
    w.append([dataclasses.replace(t, image_ids=(image.id,)) for t in group(SEED, gid, N)],
             images=[image])
  assert w.commit.images == 5 * N and w.commit.image_bytes > 500
  fresh = TrajectoryStore.open(store.url)
  metas = fresh.list_committed("u")
  payload = fresh.read(metas).result()
  check_payload(payload, SEED, N)
  for m in metas:
    np.testing.assert_array_equal(payload.images[m.image_ids[0]], images[m.group_id].array)
  sizes = {os.path.getsize(p) for p in (tmp_path / "s" / "u" / "images" / "data" / "c").iterdir()}
  assert sizes == {100 + 4 * checksum}  # whole chunk files only


def _no_big_joins(concatenate):
  """np.concatenate that refuses to join more than 100 bytes of image copies."""
  def checked(arrays, *args, **kw):
    arrays = list(arrays)
    if arrays and all(getattr(a, "dtype", None) == np.uint8 for a in arrays) and sum(
        a.size for a in arrays) > 100 and len(arrays) > 1:
      raise AssertionError("image bytes joined before the write")
    return concatenate(arrays, *args, **kw)
  return checked


def _fail_on(fragment: str, real):
  def replace(path, *args, **kw):
    if fragment in path:
      raise OSError("injected write failure")
    return real(path, *args, **kw)
  return replace
