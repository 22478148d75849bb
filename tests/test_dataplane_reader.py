"""The on-demand prefetching reader: same data at any depth, rows and images read
once per consumer, errors surface where the data is needed, clean shutdown."""
import dataclasses
import os

import numpy as np
import pytest
from store_helpers import SOURCES, group

from knittrans_jax.dataplane import DataReadError, PrefetchingReader
from knittrans_jax.storage import StoreSchema, TrajectoryStore, image_id

N = 4


@pytest.fixture
def store(tmp_path):
  return _build(f"file://{tmp_path}/s")


def _build(url, dedup_images=True):
  st = TrajectoryStore.create(url, StoreSchema(
      sources=SOURCES, max_response_len=512, token_chunk=512, row_chunk=16,
      dedup_images=dedup_images))
  rng = np.random.default_rng(0)
  images = [rng.random((16, 16, 3), dtype=np.float32) for _ in range(6)]
  for u in range(2):
    w = st.writer(f"u{u}")
    for g in range(6):
      gid = 100 * u + g
      img = images[(gid * 7) % 6]
      w.append([dataclasses.replace(t, image_ids=(image_id(img),)) for t in group(1, gid, N)],
               images=[img])
  return st


def plan_of(store, micro=5):
  metas = store.list_committed()
  order = np.random.default_rng(3).permutation(len(metas))
  metas = [metas[i] for i in order]
  return [metas[k:k + micro] for k in range(0, len(metas), micro)]


def flat(payload):
  return ([m.id for m in payload.metas], [t.copy() for t in payload.tokens],
          [lp.copy() for lp in payload.logprobs], {k: v.copy() for k, v in payload.images.items()})


def test_same_data_at_every_depth_and_as_a_direct_read(store):
  plan = plan_of(store)
  direct = [flat(store.read(mb).result()) for mb in plan]
  for depth in (1, 2, 4):
    with PrefetchingReader(store, plan, flat, depth=depth) as reader:
      got = list(reader)
    assert len(got) == len(direct)
    for a, b in zip(got, direct):
      assert a[0] == b[0]
      for x, y in zip(a[1] + a[2], b[1] + b[2]):
        np.testing.assert_array_equal(x, y)
      assert a[3].keys() == b[3].keys()
      for k in a[3]:
        np.testing.assert_array_equal(a[3][k], b[3][k])
    assert reader.stats.micro_batches == len(plan) and reader.stats.exposed_wait_s >= 0


def test_rows_once_and_images_once_per_consumer(store):
  plan = plan_of(store)
  with PrefetchingReader(store, plan, lambda p: p, unit_host={"u0": "a", "u1": "b"},
                         host="a") as reader:
    list(reader)
  local = sum(m.length * 9 for mb in plan for m in mb if m.unit == "u0")
  assert reader.stats.bytes_local == local  # rows of units on this consumer's host
  rows = [m.id for mb in plan for m in mb]
  assert set(reader.stats.rows_read) == set(rows) and max(reader.stats.rows_read.values()) == 1
  images = {i for mb in plan for m in mb for i in m.image_ids}
  assert set(reader.stats.images_read) == images
  assert max(reader.stats.images_read.values()) == 1  # reused across micro-batches
  seq = sum(m.length * 9 for mb in plan for m in mb)
  assert reader.stats.bytes_read == seq + len(images) * 16 * 16 * 3 * 4


def test_without_dedup_every_micro_batch_reads_its_trajectories_copies(store, tmp_path):
  """The equal-bytes layout: the same micro-batches, but each trajectory's own image
  copy is read (and counted), as a system that ships an image per trajectory moves."""
  copies = _build(f"file://{tmp_path}/copies", dedup_images=False)
  plan = plan_of(store)
  assert plan_of(copies) == plan
  with PrefetchingReader(store, plan, flat) as a, PrefetchingReader(copies, plan, flat) as b:
    for x, y in zip(a, b):
      assert x[0] == y[0] and x[3].keys() == y[3].keys()
      for u, v in zip(x[1] + x[2] + list(x[3].values()), y[1] + y[2] + list(y[3].values())):
        np.testing.assert_array_equal(u, v)
  per_mb = [{i for m in mb for i in m.image_ids} for mb in plan]
  assert b.stats.images_read == {i: sum(i in ids for ids in per_mb) for i in set().union(*per_mb)}
  seq = sum(m.length * 9 for mb in plan for m in mb)
  refs = sum(len(m.image_ids) for mb in plan for m in mb)
  assert b.stats.bytes_read == seq + refs * 16 * 16 * 3 * 4
  assert a.stats.bytes_read == seq + len(set().union(*per_mb)) * 16 * 16 * 3 * 4


def test_read_error_surfaces_at_its_micro_batch_and_the_reader_stops(store, tmp_path):
  plan = plan_of(store)
  bad = next(k for k, mb in enumerate(plan) if k >= 2 and any(m.unit == "u1" for m in mb))
  for k in range(bad):  # keep earlier micro-batches readable: only u1 breaks
    plan[k] = [m for m in plan[k] if m.unit == "u0"] or plan[k][:0]
  plan = [mb for mb in plan if mb]
  bad = next(k for k, mb in enumerate(plan) if any(m.unit == "u1" for m in mb))
  os.remove(tmp_path / "s" / "u1" / "sequences" / "c" / "0")
  reader = PrefetchingReader(TrajectoryStore.open(store.url), plan, lambda p: p, depth=2)
  for _ in range(bad):
    next(reader)
  with pytest.raises(DataReadError, match=rf"micro-batch {bad} \(units \[.*'u1'.*\], rows"):
    next(reader)
  reader.close()
  assert not reader._thread.is_alive()


def test_quarantining_read_skips_only_the_damaged_rows(store, tmp_path):
  """The job's reader: a deleted chunk quarantines its unit; every micro-batch still
  arrives, with exactly the rows that can be read, equal to a direct read."""
  from knittrans_jax.storage.quarantine import QuarantiningReader
  plan = plan_of(store)
  direct = {m.id: t for mb in plan for m, t in zip(*(lambda p: (p.metas, p.tokens))(
      store.read(mb).result()))}
  os.remove(tmp_path / "s" / "u1" / "sequences" / "c" / "0")  # u1's first token chunk
  fresh = TrajectoryStore.open(store.url)
  q = QuarantiningReader(fresh)
  with PrefetchingReader(fresh, plan, flat, depth=2, read=q.read) as reader:
    got = list(reader)
  assert len(got) == len(plan)
  assert set(q.quarantined) == {"u1"}
  hit = {m.id for mb in plan for m in mb if m.unit == "u1" and m.token_start < 512}
  assert set(q.bad_rows) == hit and hit
  for mb, (ids, tokens, _, images) in zip(plan, got):
    assert ids == [m.id for m in mb if m.id not in hit]
    for i, t in zip(ids, tokens):
      np.testing.assert_array_equal(t, direct[i])
    assert set(images) == {i for m in mb if m.id not in hit for i in m.image_ids}


def test_a_stream_reads_segments_in_order_and_a_failed_first_job_stops_it(store):
  """One reader fed several mini-batches (segments), each with an optional first job
  (the encode-once image slots): items come in feed order; a first job that fails
  surfaces as DataReadError at its turn and the thread stops."""
  plan = plan_of(store)
  reader = PrefetchingReader(store, depth=2)
  reader.feed(plan[:2], flat, first=lambda read: "slots-0")
  reader.feed(plan[2:3], flat)
  assert reader.take() == "slots-0"
  got = [reader.take()[0] for _ in range(3)]
  assert got == [[m.id for m in mb] for mb in plan[:3]]

  def broken(read):
    raise OSError("image chunk unreadable")
  reader.feed(plan[3:4], flat, first=broken)
  with pytest.raises(DataReadError, match="image slots failed: image chunk unreadable"):
    reader.take()
  assert not reader._thread.is_alive()
  with pytest.raises(DataReadError, match="stopped after an earlier error"):
    reader.take()


def test_close_midway_stops_the_thread(store):
  plan = plan_of(store, micro=2)
  reader = PrefetchingReader(store, plan, lambda p: p, depth=1)
  next(reader)
  reader.close()
  assert not reader._thread.is_alive()
  with pytest.raises(ValueError, match="depth"):
    PrefetchingReader(store, plan, lambda p: p, depth=0)


def test_centralized_baseline_delivers_the_same_micro_batches(store):
  from knittrans_jax.dataplane import centralized as C
  plan = plan_of(store)
  all_metas = [m for mb in plan for m in mb]
  data = C.serialize(C.consumer_slice(C.gather(store, all_metas), plan))
  received = [C.to_payload(samples) for samples in C.deserialize(data)]
  with PrefetchingReader(store, plan, flat) as reader:
    ondemand = list(reader)
  for payload, b in zip(received, ondemand):
    a = flat(payload)
    assert a[0] == b[0]
    for x, y in zip(a[1] + a[2], b[1] + b[2]):
      np.testing.assert_array_equal(x, y)
    for k in b[3]:
      np.testing.assert_array_equal(a[3][k], b[3][k])
  # Images travel once per trajectory in the baseline, once per consumer on demand.
  per_traj = sum(len(m.image_ids) for m in all_metas) * 16 * 16 * 3 * 4
  assert len(data) > per_traj
