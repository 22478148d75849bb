"""Retention (storage/retention.py): rows below a unit's low watermark are reclaimed
by its writer; what rows at or above it need is kept and reads back unchanged; a
reclaimed row is a clear error, never another row's bytes; a writer killed while
reclaiming finishes on reopening; `retention = 'all'` keeps everything."""
from __future__ import annotations

import os

import numpy as np
import pytest

from knittrans_jax.job.reclaim import WatermarkPublisher
from knittrans_jax.storage import StoreSchema, TrajectoryStore, chunk_pool, file_chunks
from knittrans_jax.storage import layout as L
from knittrans_jax.storage.errors import CorruptUnitError
from knittrans_jax.storage.images import Image
from knittrans_jax.storage.retention import (RECLAIMED_KEY, ReclaimedRowError, Records,
                                             unit_bytes)
from knittrans_jax.types import Trajectory

N = 4  # trajectories per group


def _group(rng, gid, image=None):
  prompt = rng.integers(0, 1000, 30, dtype=np.int32)
  out = []
  for i in range(N):
    R = int(rng.integers(20, 60))
    out.append(Trajectory(
        prompt_tokens=prompt, response_tokens=rng.integers(0, 1000, R, dtype=np.int32),
        logprobs=-rng.random(R, dtype=np.float32), loss_mask=np.ones(R, bool), reward=float(i),
        source="math", group_id=gid, index_in_group=i, versions=(0,),
        image_ids=(image.id,) if image is not None else ()))
  return out


def _store(url, dedup=True, retention="trained"):
  # Small chunks: a few groups fill several of every array's chunks.
  return TrajectoryStore.create(url, StoreSchema(
      sources=("math",), token_chunk=256, row_chunk=8, image_chunk_bytes=4096,
      dedup_images=dedup, retention=retention))


def _fill(store, groups=40, seed=0):
  rng = np.random.default_rng(seed)
  w, metas, images = store.writer("w0", reclaim_every_s=float("inf")), [], []
  for g in range(groups):
    im = Image.of(rng.random((16, 16, 3), dtype=np.float32))
    images.append(im)
    metas += w.append(_group(rng, g, im), [im] * (1 if store.schema.dedup_images else N))
  return w, metas, images


def _chunk_files(store, unit="w0"):
  root = file_chunks.local_path(L.join(store.url, unit))
  return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
                for f in fs if f"{os.sep}c{os.sep}" in os.path.join(d, f) + os.sep
                and f"{os.sep}{chunk_pool.FREE_DIR}{os.sep}" not in os.path.join(d, "") )


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
  if request.param == "memory":
    return f"memory://retention_{request.node.name}/"
  return f"file://{tmp_path}/store"


@pytest.mark.parametrize("dedup", [True, False])
def test_reclaims_below_the_watermark_and_keeps_what_live_rows_need(url, dedup):
  store = _store(url, dedup)
  w, metas, images = _fill(store)
  before = store.read(metas).result()
  W = 100  # groups 0-24 below it
  assert store.retain_from("w0", W) == W
  assert w.reclaim() > 0
  assert store.retain_from("w0", W - 10) == W  # never lowered
  floors = w._reclaimer.floors
  assert floors.watermark == W and floors.images == (25 if dedup else W)
  reader = TrajectoryStore.open(url)
  live = reader.read(metas[W:]).result()
  for name in ("tokens", "logprobs", "loss_mask"):
    for a, b in zip(getattr(live, name), getattr(before, name)[W:]):
      np.testing.assert_array_equal(a, b)
  assert set(live.images) == {im.id for im in images[25:]}
  assert [m.row for m in reader.reader("w0").list(W)] == list(range(W, 160))
  assert reader.reader("w0").image_ids() == [im.id for im in images[25:]] if dedup else True
  # A reclaimed row: a clear error naming unit, row and watermark; not corruption.
  for ask in (lambda: reader.read(metas[W - 1:W + 1]), lambda: reader.reader("w0").list(0)):
    with pytest.raises(ReclaimedRowError, match=r"'w0': row \d+ is below the unit's low "
                       r"watermark 100") as e:
      ask()
    assert not isinstance(e.value, CorruptUnitError)
  # The rows' arrays hold nothing below the floors.
  if url.startswith("file://"):
    seq = [f for f in _chunk_files(store) if f.startswith("sequences")]
    assert min(int(f.split(os.sep)[-1]) for f in seq) == floors.tokens // 256
  # A new append may use a reclaimed image again: it is stored again and reads back.
  again = w.append(_group(np.random.default_rng(9), 100, images[0]),
                   [images[0]] * (1 if dedup else N))
  got = TrajectoryStore.open(url).read(again).result()
  np.testing.assert_array_equal(got.images[images[0].id], images[0].array)


def test_a_read_that_reclamation_overtakes_is_refused_not_served(tmp_path):
  """A read issued before the watermark passed its rows, finished after their chunks
  were recycled: refused (the check after the read), never other rows' bytes."""
  store = _store(f"file://{tmp_path}/store")
  w, metas, _ = _fill(store)
  future = TrajectoryStore.open(store.url).read(metas[:20])  # issued: passes the first check
  store.retain_from("w0", 120)
  assert w.reclaim() > 0
  with pytest.raises(ReclaimedRowError, match="row 0 is below"):
    future.result()


def test_a_writer_killed_while_reclaiming_finishes_when_reopened(tmp_path, monkeypatch):
  store = _store(f"file://{tmp_path}/store")
  w, metas, _ = _fill(store)
  store.retain_from("w0", 120)
  real, calls = chunk_pool.release, []

  def die_after_three(*args):  # the process dies mid-way through its deletions
    if len(calls) == 3:
      raise KeyboardInterrupt
    calls.append(args)
    return real(*args)

  monkeypatch.setattr(chunk_pool, "release", die_after_three)
  with pytest.raises(KeyboardInterrupt):
    w.reclaim()
  monkeypatch.setattr(chunk_pool, "release", real)
  records = Records("w0", L.join(store.url, "w0"))
  now, prev = records.floors()
  assert now.watermark == 120 and prev.watermark == 0  # recorded, not finished
  w2 = store.writer("w0")  # finishes it
  now, prev = records.floors()
  assert now == prev
  keep = now.keep()
  for f in _chunk_files(store):
    name, k = f.split(os.sep + "c" + os.sep)
    if name not in keep:  # the commit marker
      continue
    chunk = {"sequences": 256}.get(name, 4096 if name == "images/data" else 8)
    assert int(k.split(os.sep)[0]) >= keep[name] // chunk, (f, keep)
  got = TrajectoryStore.open(store.url).read(metas[120:]).result()
  assert len(got.tokens) == 40
  w2.append(_group(np.random.default_rng(1), 200))


def test_a_damaged_record_is_named(tmp_path):
  store = _store(f"file://{tmp_path}/store")
  w, metas, _ = _fill(store, groups=4)
  store.retain_from("w0", 8)
  w.reclaim()
  path = tmp_path / "store" / "w0" / RECLAIMED_KEY
  raw = bytearray(path.read_bytes())
  raw[9] ^= 0xFF
  path.write_bytes(bytes(raw))
  with pytest.raises(CorruptUnitError, match="'reclaimed' record is damaged"):
    store.writer("w0")


def test_bad_watermarks_are_refused(tmp_path):
  store = _store(f"file://{tmp_path}/store")
  _fill(store, groups=2)
  with pytest.raises(ValueError, match="row 9 is beyond its 8 committed rows"):
    store.retain_from("w0", 9)
  with pytest.raises(ValueError, match="row must be an int >= 0, got -1"):
    store.retain_from("w0", -1)
  with pytest.raises(ValueError, match=r"StoreSchema.retention must be one of .* 'some'"):
    StoreSchema(retention="some")


def test_retention_all_keeps_every_row(tmp_path):
  store = _store(f"file://{tmp_path}/store", retention="all")
  w, metas, _ = _fill(store)
  assert store.retain_from("w0", 100) == 0
  assert w.reclaim() == 0
  assert len(TrajectoryStore.open(store.url).read(metas).result().tokens) == 160


def test_the_footprint_stays_flat_when_the_watermark_follows_the_writer(tmp_path):
  """A writer cycling a unit through ten times its live rows, the watermark a window
  behind: the unit's bytes after each cycle stay within 10% of the first cycle's."""
  store = _store(f"file://{tmp_path}/store")
  rng = np.random.default_rng(0)
  w = store.writer("w0", reclaim_every_s=0.0)
  live, sizes = 10, []  # groups
  for g in range(10 * live):
    im = Image.of(rng.random((16, 16, 3), dtype=np.float32))
    w.append(_group(rng, g, im), [im])
    store.retain_from("w0", max(w.num_rows - live * N, 0))
    if g % live == live - 1:
      sizes.append(unit_bytes(L.join(store.url, "w0")))
  steady = sizes[1:]
  assert max(steady) <= 1.1 * min(steady), sizes


def test_watermarks_are_published_only_once_their_checkpoint_is_durable():
  published = []
  pub = WatermarkPublisher(lambda unit, row: published.append((unit, row)) or row)
  pub.saved(2, {"a": 8, "b": 4})
  assert not pub.durable(None) and not pub.durable(1)
  assert published == []
  pub.saved(4, {"a": 16, "b": 4})
  assert pub.durable(2)  # step 4 still writing: step 2's marks
  assert published == [("a", 8), ("b", 4)]
  assert not pub.durable(2)
  pub.all_durable()
  assert published[2:] == [("a", 16)]  # b did not move
