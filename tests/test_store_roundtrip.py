import numpy as np
import pytest

from knittrans_jax.storage import (SchemaMismatchError, StoreError, StoreSchema, TrajectoryStore,
                                   UnknownUnitError, image_id)
from knittrans_jax.types import Trajectory

SCHEMA = StoreSchema(sources=("math", "vqa"), max_response_len=64, token_chunk=16, row_chunk=4)


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
  if request.param == "memory":
    return f"memory://roundtrip_{request.node.name}"
  return f"file://{tmp_path}/store"


def _traj(rng, gid, idx, images=(), versions=(3,), source="math"):
  P, R = int(rng.integers(1, 9)), int(rng.integers(1, 40))
  return Trajectory(
      prompt_tokens=rng.integers(0, 2**31 - 1, P, dtype=np.int64),
      response_tokens=rng.integers(0, 50000, R, dtype=np.int32),
      logprobs=-rng.random(R).astype(np.float64),
      loss_mask=rng.integers(0, 2, R).astype(bool),
      reward=float(rng.normal()), source=source, group_id=gid, index_in_group=idx,
      versions=versions, image_ids=tuple(images))


def test_every_field_round_trips(url):
  rng = np.random.default_rng(0)
  store = TrajectoryStore.create(url, SCHEMA)
  w = store.writer("w0", host="hostA")
  imgs = [rng.random((5, 6, 3), dtype=np.float32), rng.integers(0, 255, (4, 4), dtype=np.uint8)]
  ids = [image_id(im) for im in imgs]
  trajs = [_traj(rng, 7, 0, images=ids, versions=(4, 2, 5), source="vqa"),
           _traj(rng, 7, 1, images=ids[1:], versions=(2,), source="vqa"),
           _traj(rng, 8, 0), _traj(rng, 8, 1)]
  metas = w.append(trajs[:2], images=imgs)
  metas += w.append(trajs[2:])
  # Several chunks: sequences straddle the 16-token chunks, rows the 4-row chunks.
  more = [_traj(rng, 9 + k // 2, k % 2) for k in range(10)]
  metas += w.append(more)
  trajs += more

  reopened = TrajectoryStore.open(url)
  assert reopened.schema == SCHEMA
  assert reopened.units() == ["w0"] and reopened.unit_host("w0") == "hostA"
  listed = reopened.list_committed()
  assert listed == metas
  m0 = listed[0]
  assert (m0.version_first, m0.version_last, m0.source, m0.image_ids) == (2, 5, "vqa", tuple(ids))
  assert listed[1].image_ids == (ids[1],)

  order = [5, 0, 13, 2, 1]  # arbitrary order, some rows contiguous
  payload = reopened.read([listed[i] for i in order]).result()
  for k, i in enumerate(order):
    t, m = trajs[i], listed[i]
    P = t.prompt_tokens.size
    assert payload.metas[k] == m
    assert payload.tokens[k].dtype == np.int32
    np.testing.assert_array_equal(payload.tokens[k][:P], t.prompt_tokens)
    np.testing.assert_array_equal(payload.tokens[k][P:], t.response_tokens)
    assert payload.logprobs[k].dtype == np.float32
    np.testing.assert_array_equal(payload.logprobs[k][P:], t.logprobs.astype(np.float32))
    np.testing.assert_array_equal(payload.loss_mask[k][P:], t.loss_mask)
    assert payload.loss_mask[k].dtype == np.bool_ and not payload.loss_mask[k][:P].any()
    assert m.reward == t.reward and m.group_id == t.group_id and m.index_in_group == t.index_in_group
    assert (m.prompt_len, m.response_len) == (P, t.response_tokens.size)
    assert m.loss_tokens == m.trained_tokens == int(t.loss_mask.sum())  # random masks
  assert set(payload.images) == set(ids)
  for iid, im in zip(ids, imgs):
    assert payload.images[iid].dtype == im.dtype
    np.testing.assert_array_equal(payload.images[iid], im)


def test_incremental_listing_and_resume(url):
  rng = np.random.default_rng(1)
  store = TrajectoryStore.create(url, SCHEMA)
  watcher = store.watch()
  assert watcher.poll() == []
  w = store.writer("a")
  first = w.append([_traj(rng, 1, i) for i in range(3)])
  assert watcher.poll() == first
  assert watcher.poll() == []
  w2 = store.writer("a")  # a new writer resumes at the commit (e.g. after a restart)
  assert w2.num_rows == 3
  second = w2.append([_traj(rng, 2, i) for i in range(5)])
  assert [m.row for m in second] == [3, 4, 5, 6, 7]
  assert second[0].token_start == first[-1].token_end
  assert watcher.poll() == second
  assert store.reader("a").list(start=4, stop=6) == second[1:3]


def test_same_image_stored_once(url):
  rng = np.random.default_rng(2)
  store = TrajectoryStore.create(url, SCHEMA)
  w = store.writer("vlm")
  img = rng.random((448, 448, 3), dtype=np.float32)
  iid = image_id(img)
  group = [_traj(rng, 3, i, images=(iid,), source="vqa") for i in range(8)]
  metas = w.append(group, images=[img] * 8)  # a naive producer passes it 8 times
  assert w.commit.images == 1 and w.commit.image_bytes == img.nbytes
  w.append([_traj(rng, 4, 0, images=(iid,))], images=[img])
  assert w.commit.images == 1 and w.commit.image_bytes == img.nbytes
  assert store.reader("vlm").image_ids() == [iid]
  payload = store.read(metas).result()
  assert list(payload.images) == [iid]
  assert payload.nbytes < 2 * img.nbytes  # the image is not repeated per trajectory
  # Another unit stores its own copy, once however often it is passed.
  other = store.writer("vlm2")
  assert other.append([], images=[img, img]) == [] and other.commit.images == 1
  assert store.reader("vlm2").image_ids() == [iid]


def test_store_errors(url):
  store = TrajectoryStore.create(url, SCHEMA)
  with pytest.raises(SchemaMismatchError):
    TrajectoryStore.create(url, StoreSchema(sources=("other",)))
  with pytest.raises(UnknownUnitError, match="nope"):
    store.reader("nope")
  with pytest.raises(ValueError, match="unit name"):
    store.writer("../escape")
  with pytest.raises(StoreError, match="no trajectory store"):
    TrajectoryStore.open(url.rstrip("/") + "_missing")
  with pytest.raises(ValueError, match="scheme"):
    TrajectoryStore.open("/no/scheme")
