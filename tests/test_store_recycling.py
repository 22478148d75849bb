"""Chunk files reclaimed into an array's free pool (chunk_pool.release, recycle=True)
are taken by the unit's writer for its new chunks: written over in place, with every
committed row reading back as written and a failed append leaving nothing broken."""
import dataclasses
import os

import numpy as np
import pytest
from store_helpers import SOURCES, check_payload, group

from knittrans_jax.storage import Image, StoreError, StoreSchema, TrajectoryStore
from knittrans_jax.storage import chunk_pool, file_chunks

SEED, N = 11, 4
# Small chunks: a few appends fill several chunks of `sequences` and `images/data`.
SCHEMA = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=64, row_chunk=8,
                     image_chunk_bytes=128, dedup_images=False)


def _chunk_files(unit_dir, array: str) -> dict[int, int]:
  """Chunk index -> inode of each chunk file of a 1-D array."""
  d = os.path.join(unit_dir, *array.split("/"), "c")
  return {int(name): os.stat(os.path.join(d, name)).st_ino for name in os.listdir(d)
          if name.isdigit()}


def _reclaim(unit_dir, array: str, below: int) -> set[int]:
  """What retention does on a local store: chunks [0, below) into the free pool."""
  array_dir = os.path.join(unit_dir, *array.split("/"))
  inodes = set()
  for k, ino in _chunk_files(unit_dir, array).items():
    if k < below:
      assert chunk_pool.release(array_dir, file_chunks.chunk_path(array_dir, k, 1), recycle=True)
      inodes.add(ino)
  return inodes


def _append(w, gid: int, images: dict):
  image = Image.of(np.random.default_rng(gid).integers(0, 255, (9, 31), dtype=np.uint8))
  images[image.id] = image.array
  w.append([dataclasses.replace(t, image_ids=(image.id,)) for t in group(SEED, gid, N)],
           images=[image])


def _unit_with(tmp_path, checksum: bool, groups: int):
  """A store at tmp_path/s with unit 'u' holding `groups` groups: (url, unit dir,
  writer, images by id)."""
  url = f"file://{tmp_path}/s"
  store = TrajectoryStore.create(url, dataclasses.replace(SCHEMA, payload_checksum=checksum))
  w, images = store.writer("u"), {}
  for gid in range(groups):
    _append(w, gid, images)
  return url, tmp_path / "s" / "u", w, images


def _check_live(url: str, first_token: int, images: dict) -> int:
  """Every committed row whose tokens lie at or past `first_token` reads back as
  written, its image too; returns how many were read."""
  store = TrajectoryStore.open(url)
  metas = [m for m in store.list_committed("u") if m.token_start >= first_token]
  payload = store.read(metas).result()
  check_payload(payload, SEED, N)
  for iid, array in payload.images.items():
    np.testing.assert_array_equal(array, images[iid])
  return len(metas)


@pytest.mark.parametrize("checksum", [False, True])  # in place / replaced whole
def test_new_chunks_reuse_released_files_and_live_rows_read_back(tmp_path, checksum):
  url, unit, w, images = _unit_with(tmp_path, checksum, 8)
  tokens_before = w.commit.tokens
  assert tokens_before > 4 * 64
  # The chunks of the first two groups (rows 0..7) go to the free pool.
  below = TrajectoryStore.open(url).list_committed("u")[2 * N].token_start // 64
  freed = {"sequences": _reclaim(unit, "sequences", below),
           "images/data": _reclaim(unit, "images/data", 6)}
  assert len(freed["sequences"]) == below >= 2 and len(freed["images/data"]) == 6
  before = {a: _chunk_files(unit, a) for a in freed}
  for gid in range(8, 11):
    _append(w, gid, images)
    if gid == 9:  # a writer reopened over a chunk file that was recycled
      w = TrajectoryStore.open(url).writer("u")
  for array, inodes in freed.items():
    after = _chunk_files(unit, array)
    made = {after[k] for k in after if k not in before[array]}
    assert made, array
    # New chunks took the freed files (as many as there were) before making new ones.
    # With a crc32c a partly filled chunk is replaced whole by the next append (a new
    # file, exchanged in: a reader may still hold the old one open), so only the
    # chunks filled by the appends that made them keep their recycled file.
    if checksum:
      assert made & inodes, array
    else:
      assert len(made & inodes) == min(len(made), len(inodes)), array
    pool = unit / array / chunk_pool.FREE_DIR
    assert len(os.listdir(pool)) == max(0, len(inodes) - len(made)), array
  assert not [f for f in os.listdir(unit / "sequences" / "c") if "tmp" in f]
  first = below * 64
  assert _check_live(url, first, images) == 11 * N - len(
      [m for m in TrajectoryStore.open(url).list_committed("u") if m.token_start < first])


@pytest.mark.parametrize("checksum", [False, True])
def test_an_append_failing_after_it_took_a_free_file_leaves_committed_rows_intact(
    tmp_path, monkeypatch, checksum):
  url, unit, w, images = _unit_with(tmp_path, checksum, 6)
  freed = _reclaim(unit, "sequences", 3)
  committed = w.commit
  real_take = chunk_pool.FreePool.take

  def take_then_fail(self, dst):
    if "/sequences/" not in dst:
      return real_take(self, dst)
    assert real_take(self, dst)  # the free file is renamed into place, then the disk fails
    raise OSError("injected failure after taking a free file")
  monkeypatch.setattr(chunk_pool.FreePool, "take", take_then_fail)
  with pytest.raises(StoreError, match="injected failure after taking a free file"):
    _append(w, 6, images)
  monkeypatch.setattr(chunk_pool.FreePool, "take", real_take)
  assert w.commit == committed
  assert _check_live(url, 3 * 64, images) > 0
  assert not [f for f in os.listdir(unit / "sequences" / "c") if "tmp" in f]
  for gid in range(7, 10):  # the next appends succeed, over whatever the failed one left
    _append(w, gid, images)
  fresh = TrajectoryStore.open(url)
  live = [m for m in fresh.list_committed("u") if m.token_start >= 3 * 64]
  assert [m.group_id for m in live][-3 * N:] == [g for g in range(7, 10) for _ in range(N)]
  _check_live(url, 3 * 64, images)
  after = _chunk_files(unit, "sequences")
  assert freed & set(after.values())  # free files ended up as chunks


def test_release_between_appends_refills_the_cached_pool(tmp_path):
  """The writer lists the pool once and again only when its list runs out, so files
  released later (here: by the same process, between appends) are found."""
  url = f"file://{tmp_path}/s"
  w, images = TrajectoryStore.create(url, SCHEMA).writer("u"), {}
  unit = tmp_path / "s" / "u"
  counts = []  # chunk files, in use or free, after each append and reclamation
  for gid in range(14):
    _append(w, gid, images)
    if gid >= 4:  # keep three groups live, reclaiming the rest after each append
      if gid == 4:
        peak = len(_chunk_files(unit, "sequences"))  # every chunk so far: none reclaimed
      low = TrajectoryStore.open(url).list_committed("u")[(gid - 2) * N].token_start
      _reclaim(unit, "sequences", low // 64)
      counts.append(len(_chunk_files(unit, "sequences"))
                    + len(os.listdir(unit / "sequences" / "free")))
  assert w._chunks._pools["sequences"].taken >= 10
  # Later appends took freed files: the files never outgrew the five groups of the
  # start (the window is three), while the unit went on to 14 groups.
  assert max(counts) <= peak, (counts, peak)
  assert w.commit.tokens // 64 > 2 * peak
  _check_live(url, low - low % 64, images)


def test_bench_store_steady_state_recycles_and_stays_flat(tmp_path):
  """bench_store.py --steady_state (small): retention (the job's reclamation) feeds the free
  pools, the store's footprint stays flat and the live window reads back."""
  import importlib.util
  path = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_store.py")
  spec = importlib.util.spec_from_file_location("bench_store_under_test", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  r = bench.bench_steady_state(str(tmp_path), 0.5, 4, token_chunk=2048)
  assert r["read_matches_written"]
  assert r["chunk_files_released"] >= 3 * r["live_MiB"] * 2**20 // (9 * 2048)
  assert len(r["footprint_bytes"]) == 4 and r["footprint_flat"] < 1.1, r["footprint_bytes"]
  for key in ("append_vs_npsave", "append_vs_memcpy", "append_MBps", "npsave_MBps"):
    assert r[key] > 0, key


def test_a_free_file_goes_into_a_new_chunk_directory(tmp_path):
  """Chunks of 2-D arrays live at c/K/0: a free file taken for a new one makes c/K."""
  array_dir = str(tmp_path / "rows")
  old = file_chunks.chunk_path(array_dir, 0, 2)
  file_chunks.replace(old, np.arange(8, dtype=np.int64), checksum=True)
  ino = os.stat(old).st_ino
  assert chunk_pool.release(array_dir, old, recycle=True)
  assert not chunk_pool.release(array_dir, old, recycle=True)  # reclaimed before
  new = file_chunks.chunk_path(array_dir, 3, 2)
  file_chunks.replace(new, np.arange(8, 16, dtype=np.int64), True, chunk_pool.FreePool(array_dir))
  assert os.stat(new).st_ino == ino and not os.listdir(tmp_path / "rows" / "free")
  with open(new, "rb") as f:
    assert f.read()[:64] == np.arange(8, 16, dtype=np.int64).tobytes()
