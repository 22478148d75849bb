"""A damaged unit gives a clear error naming it; other units stay readable."""
import dataclasses
import os

import numpy as np
import pytest
from store_helpers import SOURCES, check_payload, group

from knittrans_jax.storage import CorruptUnitError, StoreSchema, TrajectoryStore
from knittrans_jax.storage import layout as L

SEED, N = 3, 4


def _store(tmp_path, **schema_kw):
  schema = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=256, row_chunk=8,
                       **schema_kw)
  root = tmp_path / "store"
  store = TrajectoryStore.create(f"file://{root}", schema)
  for k, unit in enumerate(("good", "bad")):
    w = store.writer(unit)
    for g in range(6):
      w.append(group(SEED, 100 * k + g, N))
  return store, root


def _fresh(store):
  return TrajectoryStore.open(store.url)


def _chunk(root, unit, array, index=0):
  path = root / unit / array / "c" / str(index)
  return path / "0" if path.is_dir() else path  # 2-D arrays: c/ROW_CHUNK/0


def _good_unit_still_readable(store):
  metas = store.list_committed("good")
  assert len(metas) == 6 * N
  check_payload(store.read(metas).result(), SEED, N)


@pytest.mark.parametrize("damage", ["truncate", "delete", "garbage-tokens", "garbage-logprobs",
                                    "garbage-loss_mask"])
def test_damaged_payload_chunk(tmp_path, damage):
  store, root = _store(tmp_path)
  path = _chunk(root, "bad", "sequences")
  if damage == "truncate":
    os.truncate(path, os.path.getsize(path) // 2)
  elif damage == "delete":
    os.remove(path)
  else:  # bytes no writer stores at the head of one plane: the value scan's to find
    plane = [name for name, _ in L.SEQ_FIELDS].index(damage.split("-")[1])
    offset = L.seq_plane_offsets(256)[plane]
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
  fresh = _fresh(store)
  metas = fresh.list_committed("bad")  # metadata is intact
  with pytest.raises(CorruptUnitError, match="'bad'") as err:
    fresh.read(metas[:3]).result()
  assert err.value.unit == "bad"
  _good_unit_still_readable(fresh)


def test_bit_flip_detected_with_payload_checksum(tmp_path):
  store, root = _store(tmp_path, payload_checksum=True)
  path = _chunk(root, "bad", "sequences")
  data = bytearray(path.read_bytes())
  data[10] ^= 0x40
  path.write_bytes(bytes(data))
  fresh = _fresh(store)
  with pytest.raises(CorruptUnitError, match="'bad'"):
    fresh.read(fresh.list_committed("bad")[:2]).result()
  _good_unit_still_readable(fresh)


@pytest.mark.parametrize("target", ["rows", "commit"])  # the reward: a column of rows
def test_damaged_metadata_is_detected_and_watcher_skips_the_unit(tmp_path, target):
  store, root = _store(tmp_path)
  path = _chunk(root, "bad", target)
  data = bytearray(path.read_bytes())
  data[3] ^= 0xFF  # metadata chunks carry a crc32c: a flipped bit is caught
  path.write_bytes(bytes(data))
  fresh = _fresh(store)
  with pytest.raises(CorruptUnitError, match="'bad'"):
    fresh.list_committed("bad")
  watcher = fresh.watch()
  metas = watcher.poll()
  assert set(watcher.failed) == {"bad"} and "bad" in str(watcher.failed["bad"])
  assert {m.unit for m in metas} == {"good"} and len(metas) == 6 * N
  _good_unit_still_readable(fresh)


def test_negative_rewards_are_kept_and_a_non_finite_one_is_damage(tmp_path):
  """Format 6 keeps the reward's float64 bits among the int64 row columns: a negative
  reward is a negative integer there, which must not read as a missing chunk's fill
  value, to a reader or to a writer reopening the unit mid-chunk; a NaN there (the
  bits of -1, a missing chunk's) is damage."""
  store, root = _store(tmp_path)
  rewards = [-0.5, -1e300, -0.0, 2.0]
  w = store.writer("neg")
  for g in range(3):  # a new writer each time: its tail check reads the negative rewards
    w = store.writer("neg")
    w.append([dataclasses.replace(t, reward=r) for t, r in zip(group(SEED, 500 + g, N), rewards)])
  metas = _fresh(store).list_committed("neg")
  assert [m.reward for m in metas] == rewards * 3
  assert [str(m.reward) for m in metas][2] == "-0.0"  # the bits, not a value near them
  reader = _fresh(store).reader("neg")
  reader.commit()  # opens `rows` as the unit's format has it
  rows = reader.arrays["rows"]
  row = rows[5].read().result()
  row[L.REWARD] = np.array(np.nan).view(np.int64)
  rows[5].write(row).result()  # through TensorStore: the chunk's crc32c stays valid
  with pytest.raises(CorruptUnitError, match="inconsistent"):
    _fresh(store).list_committed("neg")
  _good_unit_still_readable(_fresh(store))


def test_missing_row_chunk_is_detected(tmp_path):
  store, root = _store(tmp_path)
  os.remove(_chunk(root, "bad", "rows", index=1))  # rows 8..15 of 24
  with pytest.raises(CorruptUnitError, match="inconsistent"):
    _fresh(store).list_committed("bad")
  _good_unit_still_readable(_fresh(store))


@pytest.mark.parametrize("array", ["rows", "sequences"])
def test_unit_with_missing_arrays(tmp_path, array):
  store, root = _store(tmp_path)
  (root / "bad" / array / "zarr.json").unlink()
  fresh = _fresh(store)
  with pytest.raises(CorruptUnitError, match="'bad'.*cannot open"):
    fresh.read(fresh.list_committed("bad")).result()  # the sequences: once the format is read
  _good_unit_still_readable(fresh)


def test_missing_commit_marker_is_corrupt_not_empty(tmp_path):
  store, root = _store(tmp_path)
  os.remove(root / "bad" / "commit" / "c" / "0")
  with pytest.raises(CorruptUnitError, match="commit marker is missing"):
    _fresh(store).list_committed("bad")
  with pytest.raises(CorruptUnitError, match="'bad'"):  # a writer must not start over it
    _fresh(store).writer("bad")
  _good_unit_still_readable(_fresh(store))


@pytest.mark.parametrize("array", ["images/data", "images/hash"])
def test_damaged_image_table_is_detected(tmp_path, array):
  from knittrans_jax.storage import image_id
  schema = StoreSchema(sources=SOURCES, image_chunk_bytes=1024, row_chunk=8)
  root = tmp_path / "store"
  store = TrajectoryStore.create(f"file://{root}", schema)
  rng = np.random.default_rng(0)
  imgs = [rng.integers(0, 255, (16, 16, 3), dtype=np.uint8) for _ in range(3)]
  trajs = [dataclasses.replace(t, image_ids=(image_id(imgs[k % 3]),))
           for k, t in enumerate(group(SEED, 0, N))]
  store.writer("img").append(trajs, images=imgs)
  path = _chunk(root, "img", array, 0)
  os.remove(path)
  with pytest.raises(CorruptUnitError, match="'img'"):
    fresh = _fresh(store)
    fresh.read(fresh.list_committed("img")).result()
