"""On-demand reads (dataplane/reader.py) and the trainer's prefetch stream
(job/prefetch.py): same data at any depth, rows and images read once per consumer,
errors surface where the data is needed, clean shutdown."""
import dataclasses
import os
import time

import numpy as np
import pytest
from store_helpers import SOURCES, group

from knittrans_jax.dataplane import DataReadError, OnDemandReads, describe
from knittrans_jax.job.prefetch import Inline, Prefetcher
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


def stream(reads, plan, prepare=lambda p: p, depth=2, read_images=True):
  """The trainer's use of the two: a stream of jobs, each reading and preparing one
  micro-batch."""
  seg = reads.segment(plan, read_images)
  out = Prefetcher(depth)
  out.feed([(describe(k, mb), lambda k=k: prepare(seg.micro_batch(k)))
            for k, mb in enumerate(plan)])
  return out


def take_all(s, n):
  try:
    return [s.take() for _ in range(n)]
  finally:
    s.close()


def test_same_data_at_every_depth_and_as_a_direct_read(store):
  plan = plan_of(store)
  direct = [flat(store.read(mb).result()) for mb in plan]
  for depth in (1, 2, 4):
    s = stream(OnDemandReads(store), plan, flat, depth)
    got = take_all(s, len(plan))
    assert len(got) == len(direct)
    for a, b in zip(got, direct):
      assert a[0] == b[0]
      for x, y in zip(a[1] + a[2], b[1] + b[2]):
        np.testing.assert_array_equal(x, y)
      assert a[3].keys() == b[3].keys()
      for k in a[3]:
        np.testing.assert_array_equal(a[3][k], b[3][k])
    assert s.stats.taken == len(plan) and len(s.stats.waits) == len(plan)
    assert s.stats.raw_transfer_s > 0 and s.stats.exposed_wait_s >= 0


def test_rows_once_and_images_once_per_consumer(store):
  plan = plan_of(store)
  reads = OnDemandReads(store, unit_host={"u0": "a", "u1": "b"}.get, host="a")
  seg = reads.segment(plan)
  for k in range(len(plan)):
    seg.micro_batch(k)
  local = sum(m.length * 9 for mb in plan for m in mb if m.unit == "u0")
  assert reads.stats.bytes_local == local  # rows of units on this consumer's host
  rows = [m.id for mb in plan for m in mb]
  assert set(reads.stats.rows_read) == set(rows) and max(reads.stats.rows_read.values()) == 1
  images = {i for mb in plan for m in mb for i in m.image_ids}
  assert set(reads.stats.images_read) == images
  assert max(reads.stats.images_read.values()) == 1  # reused across micro-batches
  seq = sum(m.length * 9 for mb in plan for m in mb)
  assert reads.stats.bytes_read == seq + len(images) * 16 * 16 * 3 * 4
  # Without images (the encode-once path reads its slots itself): sequences only.
  bare = OnDemandReads(store)
  seg = bare.segment(plan, read_images=False)
  assert all(not seg.micro_batch(k).images for k in range(len(plan)))
  assert bare.stats.bytes_read == seq and not bare.stats.images_read


def test_without_dedup_every_micro_batch_reads_its_trajectories_copies(store, tmp_path):
  """The equal-bytes layout: the same micro-batches, but each trajectory's own image
  copy is read (and counted), as a system that ships an image per trajectory moves."""
  copies = _build(f"file://{tmp_path}/copies", dedup_images=False)
  plan = plan_of(store)
  assert plan_of(copies) == plan
  a, b = OnDemandReads(store), OnDemandReads(copies)
  sa, sb = a.segment(plan), b.segment(plan)
  for k in range(len(plan)):
    x, y = flat(sa.micro_batch(k)), flat(sb.micro_batch(k))
    assert x[0] == y[0] and x[3].keys() == y[3].keys()
    for u, v in zip(x[1] + x[2] + list(x[3].values()), y[1] + y[2] + list(y[3].values())):
      np.testing.assert_array_equal(u, v)
  per_mb = [{i for m in mb for i in m.image_ids} for mb in plan]
  assert b.stats.images_read == {i: sum(i in ids for ids in per_mb) for i in set().union(*per_mb)}
  seq = sum(m.length * 9 for mb in plan for m in mb)
  refs = sum(len(m.image_ids) for mb in plan for m in mb)
  assert b.stats.bytes_read == seq + refs * 16 * 16 * 3 * 4
  assert a.stats.bytes_read == seq + len(set().union(*per_mb)) * 16 * 16 * 3 * 4


def test_read_error_surfaces_at_its_micro_batch_and_the_stream_stops(store, tmp_path):
  plan = plan_of(store)
  bad = next(k for k, mb in enumerate(plan) if k >= 2 and any(m.unit == "u1" for m in mb))
  for k in range(bad):  # keep earlier micro-batches readable: only u1 breaks
    plan[k] = [m for m in plan[k] if m.unit == "u0"] or plan[k][:0]
  plan = [mb for mb in plan if mb]
  bad = next(k for k, mb in enumerate(plan) if any(m.unit == "u1" for m in mb))
  os.remove(tmp_path / "s" / "u1" / "sequences" / "c" / "0")
  s = stream(OnDemandReads(TrajectoryStore.open(store.url)), plan)
  for _ in range(bad):
    s.take()
  with pytest.raises(DataReadError, match=rf"micro-batch {bad} \(units \[.*'u1'.*\], rows"):
    s.take()
  assert not s._thread.is_alive()  # stopped at the error
  with pytest.raises(DataReadError, match="stopped after an earlier error"):
    s.take()


def test_quarantining_read_skips_only_the_damaged_rows(store, tmp_path):
  """The job's reads: a deleted chunk quarantines its unit; every micro-batch still
  arrives, with exactly the rows that can be read, equal to a direct read."""
  from knittrans_jax.storage.quarantine import QuarantiningReader
  plan = plan_of(store)
  direct = {m.id: t for mb in plan for m, t in zip(*(lambda p: (p.metas, p.tokens))(
      store.read(mb).result()))}
  os.remove(tmp_path / "s" / "u1" / "sequences" / "c" / "0")  # u1's first token chunk
  fresh = TrajectoryStore.open(store.url)
  q = QuarantiningReader(fresh)
  got = take_all(stream(OnDemandReads(fresh, read=q.read), plan, flat), len(plan))
  assert len(got) == len(plan)
  assert set(q.quarantined) == {"u1"}
  hit = {m.id for mb in plan for m in mb if m.unit == "u1" and m.token_start < 512}
  assert set(q.bad_rows) == hit and hit
  for mb, (ids, tokens, _, images) in zip(plan, got):
    assert ids == [m.id for m in mb if m.id not in hit]
    for i, t in zip(ids, tokens):
      np.testing.assert_array_equal(t, direct[i])
    assert set(images) == {i for m in mb if m.id not in hit for i in m.image_ids}


def test_a_stream_runs_jobs_in_feed_order_and_a_failed_job_stops_it(store):
  """One stream fed several mini-batches, each with an optional first job (the
  encode-once image slots): items come in feed order, at most `depth` ahead of the
  takes; a job that fails surfaces as DataReadError naming it, at its turn."""
  s = Prefetcher(depth=2)
  ran = []

  def job(x):
    ran.append(x)
    return x
  s.feed([("a", lambda: job("slots-0")), ("b", lambda: job(1)), ("c", lambda: job(2)),
          ("d", lambda: job(3))])
  deadline = time.time() + 30
  while len(ran) < 3 and time.time() < deadline:
    time.sleep(0.01)
  time.sleep(0.2)
  # Two items queued and a third read, waiting for room: the fourth waits for a take.
  assert ran == ["slots-0", 1, 2]
  assert s.ready() and s.take() == "slots-0"
  s.feed([("e", lambda: job(4))])
  assert [s.take() for _ in range(4)] == [1, 2, 3, 4]
  with pytest.raises(RuntimeError, match="feed\\(\\) first"):
    s.take()

  def broken():
    raise OSError("image chunk unreadable")
  s.feed([("the image slots", broken), ("f", lambda: job(5))])
  with pytest.raises(DataReadError, match="reading the image slots failed: image chunk unreadable"):
    s.take()
  assert not s._thread.is_alive() and 5 not in ran  # stopped at the error


def test_close_midway_stops_the_thread(store):
  plan = plan_of(store, micro=2)
  s = stream(OnDemandReads(store), plan, depth=1)
  s.take()
  s.close()
  assert not s._thread.is_alive()
  s.close()  # twice is fine
  with pytest.raises(ValueError, match="depth"):
    Prefetcher(depth=0)


def test_centralized_baseline_delivers_the_same_micro_batches(store):
  from knittrans_jax.dataplane import centralized as C
  plan = plan_of(store)
  all_metas = [m for mb in plan for m in mb]
  data = C.serialize(C.consumer_slice(C.gather(store, all_metas), plan))
  received = [C.to_payload(samples) for samples in C.deserialize(data)]
  seg = OnDemandReads(store).segment(plan)
  ondemand = [flat(seg.micro_batch(k)) for k in range(len(plan))]
  # The baseline behind the same interface, on the inline stream: one fetch of the
  # whole plan when the first item is taken, every wait exposed.
  fetched = []
  central = C.CentralizedReads(lambda p: fetched.append(p) or received)
  cseg = central.segment(plan)
  inline = Inline()
  inline.feed([(describe(k, mb), lambda k=k: flat(cseg.micro_batch(k)))
               for k, mb in enumerate(plan)])
  assert not inline.ready() and not fetched
  via_inline = [inline.take() for _ in plan]
  assert len(fetched) == 1 and inline.stats.exposed_wait_s == inline.stats.raw_transfer_s > 0
  for a, b, c in zip(map(flat, received), ondemand, via_inline):
    assert a[0] == b[0] == c[0]
    for x, y in zip(a[1] + a[2], b[1] + b[2]):
      np.testing.assert_array_equal(x, y)
    for k in b[3]:
      np.testing.assert_array_equal(a[3][k], b[3][k])
  assert set(central.stats.rows_read) == {m.id for m in all_metas}
  # Images travel once per trajectory in the baseline, once per consumer on demand.
  per_traj = sum(len(m.image_ids) for m in all_metas) * 16 * 16 * 3 * 4
  assert len(data) > per_traj
