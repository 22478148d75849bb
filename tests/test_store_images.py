"""The image table: one hash per image, checked on every read; the per-trajectory
(no-dedup) layout; units of older formats refused by name."""
import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
import tensorstore as ts
import xxhash
from store_helpers import SOURCES, group

from knittrans_jax.storage import (CorruptUnitError, Image, StoreSchema,
                                   TrajectoryStore, TrajectoryValidationError, image_id)
from knittrans_jax.storage import layout as L

SEED, N = 5, 8
SHAPE = (16, 16, 3)  # 768 bytes of uint8: one image per 768-byte chunk below


def _schema(**kw):
  return StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=512, row_chunk=8,
                     image_chunk_bytes=768, **kw)


def _images(k, seed=0):
  rng = np.random.default_rng(seed)
  return [Image.of(rng.integers(0, 255, SHAPE, dtype=np.uint8)) for _ in range(k)]


def _with_images(trajs, *images):
  return [dataclasses.replace(t, image_ids=tuple(im.id for im in images)) for t in trajs]


def _write_groups(store, unit, images, groups=2):
  """Group g's trajectories all show images[g]; one append per group."""
  w = store.writer(unit)
  return [m for g in range(groups)
          for m in w.append(_with_images(group(SEED, g, N), images[g]), images=[images[g]])]


@pytest.fixture
def count_hashes(monkeypatch):
  """Counts every image hash computed, by algorithm."""
  calls = {"xxh3_128": 0, "blake2b": 0}
  xxh3, blake2b = xxhash.xxh3_128, hashlib.blake2b

  def counting_xxh3(*a, **kw):
    calls["xxh3_128"] += 1
    return xxh3(*a, **kw)

  def counting_blake2b(*a, **kw):
    calls["blake2b"] += 1
    return blake2b(*a, **kw)

  monkeypatch.setattr(xxhash, "xxh3_128", counting_xxh3)
  monkeypatch.setattr(hashlib, "blake2b", counting_blake2b)
  return calls


@pytest.mark.parametrize("dedup", [True, False])
def test_an_image_is_hashed_once_where_it_is_made_and_once_per_read(count_hashes, dedup):
  store = TrajectoryStore.create(f"memory://hash_once_{dedup}", _schema(dedup_images=dedup))
  array = np.random.default_rng(1).integers(0, 255, SHAPE, dtype=np.uint8)
  image = Image.of(array)  # the producer's hash
  assert count_hashes == {"xxh3_128": 1, "blake2b": 0}
  metas = store.writer("u").append(_with_images(group(SEED, 0, N), image), images=[image])
  assert count_hashes["xxh3_128"] == 1  # the writer trusts the id it was given
  payload = TrajectoryStore.open(store.url).read(metas).result()
  np.testing.assert_array_equal(payload.images[image.id], array)
  # The read checks each copy it moves: one image with dedup, one per trajectory without.
  assert count_hashes == {"xxh3_128": 1 + (1 if dedup else N), "blake2b": 0}


def test_a_bare_array_is_hashed_once_by_the_writer(count_hashes):
  store = TrajectoryStore.create("memory://hash_bare", _schema())
  array = np.random.default_rng(2).integers(0, 255, SHAPE, dtype=np.uint8)
  iid = image_id(array)
  count_hashes["xxh3_128"] = 0
  w = store.writer("u")
  w.append(_with_images(group(SEED, 0, N), Image(iid, array)), images=[array] * N)
  assert count_hashes["xxh3_128"] == 1  # the same array object N times: hashed once
  w.append([], images=[array, array])  # a later call hashes it again, once
  assert count_hashes["xxh3_128"] == 2 and w.commit.images == 1


def test_a_wrong_id_is_stored_as_given_and_caught_on_read():
  store = TrajectoryStore.create("memory://hash_wrong", _schema())
  a, b = _images(2)
  liar = Image(a.id, b.array)  # e.g. the array was changed after its id was made
  metas = store.writer("u").append(_with_images(group(SEED, 0, N), liar), images=[liar])
  with pytest.raises(CorruptUnitError, match=f"'u'.*image {a.id} .*content hash"):
    store.read(metas).result()
  with pytest.raises(ValueError, match="image 0: Image.id 'nope' is not a 32-digit"):
    store.writer("v").append([], images=[Image("nope", a.array)])


def _flip_byte(path, offset):
  data = bytearray(path.read_bytes())
  data[offset] ^= 0x01
  path.write_bytes(bytes(data))


def _data_chunk(root, unit, k):
  return root / unit / "images" / "data" / "c" / str(k)


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("checksum", [False, True])
def test_a_damaged_image_byte_is_detected_on_read(tmp_path, dedup, checksum):
  root = tmp_path / "store"
  store = TrajectoryStore.create(f"file://{root}", _schema(dedup_images=dedup,
                                                            payload_checksum=checksum))
  images = _images(2)
  metas = _write_groups(store, "bad", images)
  _write_groups(store, "good", images)
  damaged = 1 if dedup else N + 3  # the second image; without dedup, row 11's own copy
  _flip_byte(_data_chunk(root, "bad", damaged), 100)
  fresh = TrajectoryStore.open(store.url)
  with pytest.raises(CorruptUnitError, match=f"'bad'.*image {images[1].id} \\(image table row "
                     f"{damaged}") as err:
    fresh.read(fresh.list_committed("bad")).result()
  assert err.value.unit == "bad"
  fresh.read(fresh.list_committed("good")).result()
  if not dedup:  # the other copies of the same image are intact
    intact = [m for m in metas if m.row != N + 3]
    assert list(fresh.read(intact).result().images) == [im.id for im in images]


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("checksum", [False, True])
def test_swapped_images_are_detected(tmp_path, dedup, checksum):
  """Two images' payloads exchanged (whole chunks, each with a valid crc32c when
  payload checksums are on) are caught by the id check."""
  root = tmp_path / "store"
  store = TrajectoryStore.create(f"file://{root}", _schema(dedup_images=dedup,
                                                            payload_checksum=checksum))
  images = _images(2)
  metas = _write_groups(store, "u", images)
  a, b = _data_chunk(root, "u", 0), _data_chunk(root, "u", N if not dedup else 1)
  da, db = a.read_bytes(), b.read_bytes()
  a.write_bytes(db)
  b.write_bytes(da)
  fresh = TrajectoryStore.open(store.url)
  for m, image in ((metas[0], images[0]), (metas[N], images[1])):
    with pytest.raises(CorruptUnitError, match=f"'u'.*image {image.id} .*another image's"):
      fresh.read([m]).result()


def test_no_dedup_round_trips_and_holds_a_copy_per_trajectory(tmp_path):
  images = _images(3, seed=7)
  stores = {}
  for dedup in (True, False):
    root = tmp_path / f"dedup{int(dedup)}"
    store = stores[dedup] = TrajectoryStore.create(f"file://{root}", _schema(dedup_images=dedup))
    w = store.writer("u")
    # Group 0 shares one image; group 1 shows two, the second also group 0's.
    w.append(_with_images(group(SEED, 0, N), images[0]), images=[images[0]])
    w.append(_with_images(group(SEED, 1, N), images[1], images[0]), images=images[:2])
    w.append(_with_images(group(SEED, 2, 2), images[2]), images=[images[2], images[2]])
    assert w.commit.images == (3 if dedup else N + 2 * N + 2)
    data = root / "u" / "images" / "data" / "c"
    on_disk = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    assert on_disk == w.commit.images * 768  # one 768-byte chunk per copy
  ded, nod = (TrajectoryStore.open(stores[d].url) for d in (True, False))
  assert ded.list_committed() == nod.list_committed()
  metas = nod.list_committed()
  order = [9, 0, 17, 8, 3, 16]
  for s in (ded, nod):
    payload = s.read([metas[i] for i in order]).result()
    assert list(payload.images) == [images[1].id, images[0].id, images[2].id]
    for im in images:
      np.testing.assert_array_equal(payload.images[im.id], im.array)
    # Without dedup each trajectory's copies are read: 1 + 2 + 1 + 2 + 1 + 1.
    assert payload.image_bytes_read == 768 * (3 if s is ded else 8)
    assert payload.nbytes_read - payload.nbytes == (0 if s is ded else 768 * 5)
  # Rows never listed by this reader locate their copies through their refs.
  cold = TrajectoryStore.open(nod.url).read([metas[11], metas[17]], skip_images={images[0].id})
  assert list(cold.result().images) == [images[1].id, images[2].id]
  # A resumed writer goes on appending copies.
  w = stores[False].writer("u")
  more = w.append(_with_images(group(SEED, 3, 2), images[0]), images=[images[0]])
  assert w.commit.images == N + 2 * N + 2 + 2
  np.testing.assert_array_equal(nod.read(more).result().images[images[0].id], images[0].array)


def test_quarantining_reader_counts_every_copy_it_read(tmp_path):
  """Its payload's nbytes_read equals the store's: each trajectory's own copy counts
  without dedup; with a quarantined unit, the copies of the rows read one by one."""
  from knittrans_jax.storage.quarantine import QuarantiningReader
  images = _images(4, seed=3)
  for dedup in (True, False):
    store = TrajectoryStore.create(f"file://{tmp_path}/q{int(dedup)}", _schema(dedup_images=dedup))
    metas = _write_groups(store, "a", images[:2]) + _write_groups(store, "b", images[2:])
    pick = metas[:3] + metas[N:N + 2] + metas[2 * N:2 * N + 3]  # 8 rows, 3 images
    direct = store.read(pick).result()
    assert direct.image_bytes_read == 768 * (3 if dedup else 8)
    q = QuarantiningReader(TrajectoryStore.open(store.url))
    assert q.read(pick).nbytes_read == direct.nbytes_read
    # Damage unit b's image (with dedup, the one copy; without, row 2N+1's copy): b is
    # quarantined and read row by row, and each row that reads moves its own copy.
    _flip_byte(_data_chunk(tmp_path / f"q{int(dedup)}", "b", 0 if dedup else 1), 5)
    q = QuarantiningReader(TrajectoryStore.open(store.url))
    got = q.read(pick)
    assert set(q.quarantined) == {"b"}
    kept = pick[:5] if dedup else pick[:6] + pick[7:]
    assert [m.id for m in got.metas] == [m.id for m in kept]
    assert got.image_bytes_read == 768 * (2 if dedup else 5 + 2)
    assert got.nbytes_read == got.nbytes + (0 if dedup else 768 * 4)


def test_no_dedup_needs_the_images_in_the_same_call():
  store = TrajectoryStore.create("memory://nodedup_errors", _schema(dedup_images=False))
  w = store.writer("u")
  image = _images(1)[0]
  w.append(_with_images(group(SEED, 0, 2), image), images=[image])
  with pytest.raises(TrajectoryValidationError, match="'image_ids'.*dedup_images=False"):
    w.append(_with_images(group(SEED, 1, 2), image))
  with pytest.raises(ValueError, match="dedup_images must be a bool"):
    StoreSchema(dedup_images="no")


def test_a_store_json_without_dedup_images_opens_with_dedup(tmp_path):
  store = TrajectoryStore.create(f"file://{tmp_path}/s", _schema())
  path = tmp_path / "s" / "store.json"
  fields = json.loads(path.read_text())
  del fields["dedup_images"]  # as written before the field existed
  path.write_text(json.dumps(fields))
  assert TrajectoryStore.open(store.url).schema == _schema()
  TrajectoryStore.create(store.url, _schema())  # the same schema: no mismatch


def test_a_unit_of_an_unknown_or_old_format_is_refused_clearly(tmp_path):
  root = tmp_path / "store"
  store = TrajectoryStore.create(f"file://{root}", _schema())
  store.writer("u").append(group(SEED, 0, 2))
  spec = L.unit_arrays(L.join(f"file://{root}", "u"), _schema())
  commit = ts.open(spec["commit"]).result()
  raw = commit.read().result()
  old = r": an old store; commit {} of knittrans_jax reads it"
  for fmt, why in ((99, "$"), (2, old.format("c68bd4c")), (3, old.format("7efc00a")),
                   (4, old.format("7efc00a")), (5, old.format("7efc00a"))):
    raw[L.C_FORMAT] = fmt
    commit.write(raw).result()
    msg = rf"'u'.*format {fmt} is not one this version reads \(6\){why}"
    with pytest.raises(CorruptUnitError, match=msg):
      TrajectoryStore.open(store.url).list_committed("u")
    with pytest.raises(CorruptUnitError, match=msg):  # nor appended to, empty or not
      TrajectoryStore.open(store.url).writer("u")
  assert os.path.exists(root / "u" / "unit.json")
