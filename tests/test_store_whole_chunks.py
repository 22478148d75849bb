"""Appends write whole chunks from the committed tails the writer keeps
(storage/whole_chunks.py): resumed writers and failed appends keep every byte."""
import dataclasses

import numpy as np
import pytest
import tensorstore as ts
from store_helpers import SOURCES, check_payload, group

from knittrans_jax.storage import Image, StoreError, StoreSchema, TrajectoryStore
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


def test_resumed_writers_and_a_failed_append_keep_every_committed_byte(tmp_path):
  store = TrajectoryStore.create(f"file://{tmp_path}/s", SCHEMA)
  rng = np.random.default_rng(SEED)
  images = [Image.of(rng.integers(0, 255, (7, 9), dtype=np.uint8)) for _ in range(7)]
  w = store.writer("u")
  for gid in range(12):
    if gid in (4, 9):  # a new writer resumes mid-chunk from what is on the store
      w = store.writer("u")
    if gid == 7:  # a failed append, after its other writes: nothing of it commits
      real = w._arrays["reward"]
      w._arrays["reward"] = _FailingWrites(real)
      with pytest.raises(StoreError, match="injected write failure"):
        w.append([dataclasses.replace(t, image_ids=(images[6].id,)) for t in group(SEED, 99, N)],
                 images=[images[6]])
      w._arrays["reward"] = real
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
