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

  def failing_reward(path, *args, **kw):
    if "/reward/" in path:
      raise OSError("injected write failure")
    return real_replace(path, *args, **kw)
  rng = np.random.default_rng(SEED)
  images = [Image.of(rng.integers(0, 255, (7, 9), dtype=np.uint8)) for _ in range(7)]
  w = store.writer("u")
  for gid in range(12):
    if gid in (4, 9):  # a new writer resumes mid-chunk from what is on the store
      w = store.writer("u")
    if gid == 7:  # a failed append, after its other writes: nothing of it commits
      real = w._arrays["reward"]
      w._arrays["reward"] = _FailingWrites(real)
      monkeypatch.setattr(file_chunks, "replace", failing_reward)
      with pytest.raises(StoreError, match="injected write failure"):
        w.append([dataclasses.replace(t, image_ids=(images[6].id,)) for t in group(SEED, 99, N)],
                 images=[images[6]])
      w._arrays["reward"] = real
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
  # Past the committed extent, the last chunks hold fill values.
  arrays = fresh.reader("u").arrays
  k, j = divmod(commit.tokens, 64)
  assert j, "the test wants a partly filled last chunk"
  last = arrays["sequences"][k * 64 * L.SEQ_BYTES:(k + 1) * 64 * L.SEQ_BYTES].read().result()
  for o, (_, dt) in zip(L.seq_plane_offsets(64), L.SEQ_FIELDS):  # each plane's end
    assert (last[o + j * dt.itemsize:o + 64 * dt.itemsize] == L.SEQ_FILL).all()
  assert np.isnan(arrays["reward"][commit.rows:-(-commit.rows // 4) * 4].read().result()).all()


@pytest.mark.parametrize("checksum,exchange", [(False, True), (True, True), (False, False)])
def test_direct_writes_equal_tensorstore_writes(tmp_path, monkeypatch, checksum, exchange):
  """A local unit's chunk files, written directly (in place for `sequences` without
  crc32c; replaced by exchanging names, or by plain renames where the kernel cannot
  exchange), hold the bytes TensorStore's writes (durable: its file driver) leave."""
  import os
  if not exchange:
    monkeypatch.setattr(file_chunks, "_RENAMEAT2", None)
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
