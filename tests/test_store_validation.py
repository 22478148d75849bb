"""Each bad input gets a clear error naming the field; nothing of the call is written."""
import dataclasses

import numpy as np
import pytest

from knittrans_jax.storage import (SchemaMismatchError, StoreSchema, TrajectoryStore,
                                   TrajectoryValidationError, image_id)
from knittrans_jax.types import Trajectory

SCHEMA = StoreSchema(sources=("math", "vqa"), max_prompt_len=16, max_response_len=32)


def good(gid=0, idx=0, R=5, **changes):
  t = Trajectory(prompt_tokens=np.arange(4, dtype=np.int32), response_tokens=np.arange(R) + 10,
                 logprobs=np.full(R, -0.5, np.float32), loss_mask=np.ones(R, bool), reward=1.0,
                 source="math", group_id=gid, index_in_group=idx, versions=(0,))
  return dataclasses.replace(t, **changes)


BAD = {
    "float tokens": ("response_tokens", dict(response_tokens=np.ones(5, np.float32))),
    "2-D tokens": ("prompt_tokens", dict(prompt_tokens=np.ones((2, 2), np.int32))),
    "negative token": ("prompt_tokens", dict(prompt_tokens=np.array([1, -3]))),
    "negative int32 token": ("response_tokens",
                             dict(response_tokens=np.array([10, 11, -1, 12, 13], np.int32))),
    "token beyond int32": ("response_tokens", dict(response_tokens=np.arange(5) + 2**31)),
    "empty response": ("response_tokens", dict(response_tokens=np.zeros(0, np.int32),
                                               logprobs=np.zeros(0), loss_mask=np.zeros(0, bool))),
    "too long": ("response_tokens", dict(response_tokens=np.ones(33, np.int32),
                                         logprobs=np.zeros(33), loss_mask=np.ones(33, bool))),
    "logprob shape": ("logprobs", dict(logprobs=np.zeros(4, np.float32))),
    "int logprobs": ("logprobs", dict(logprobs=np.zeros(5, np.int32))),
    "nan logprob": ("logprobs", dict(logprobs=np.array([0, -1, np.nan, 0, 0], np.float32))),
    "mask shape": ("loss_mask", dict(loss_mask=np.ones(6, bool))),
    "mask values": ("loss_mask", dict(loss_mask=np.array([0, 1, 2, 1, 1]))),
    "nan reward": ("reward", dict(reward=float("nan"))),
    "inf reward": ("reward", dict(reward=float("inf"))),
    "str reward": ("reward", dict(reward="1.0")),
    "unknown source": ("source", dict(source="poetry")),
    "no versions": ("versions", dict(versions=())),
    "negative version": ("versions", dict(versions=(2, -1))),
    "float group": ("group_id", dict(group_id=1.5)),
    "missing image": ("image_ids", dict(image_ids=("deadbeef" * 4,))),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_and_unit_stays_usable(case, tmp_path):
  field, changes = BAD[case]
  store = TrajectoryStore.create(f"file://{tmp_path}/s", SCHEMA)
  w = store.writer("u")
  before = w.append([good(0, 0), good(0, 1)])
  commit = w.commit
  # The bad trajectory is third in a call whose first two are fine: none is written.
  call = [good(1, 0), good(1, 1), good(1, 2, **changes)]
  with pytest.raises(TrajectoryValidationError) as err:
    w.append(call)
  assert err.value.field == field and err.value.index == 2
  assert f"'{field}'" in str(err.value) and "trajectory 2" in str(err.value)
  assert w.commit == commit
  assert store.list_committed() == before
  after = w.append([good(2, 0)])  # still usable
  assert after[0].row == 2 and after[0].token_start == before[-1].token_end
  payload = TrajectoryStore.open(store.url).read(before + after).result()
  np.testing.assert_array_equal(payload.tokens[0], np.r_[np.arange(4), np.arange(5) + 10])


def test_the_first_bad_field_is_named_when_several_are_bad():
  # int32 token and float32 log-prob values are checked over the whole call first;
  # the error still names the first bad field in call order.
  store = TrajectoryStore.create("memory://validation_first", SCHEMA)
  nan = np.array([0, np.nan, 0, 0, 0], np.float32)
  calls = {("logprobs", 1): [good(), good(logprobs=nan), good(source="poetry")],
           ("prompt_tokens", 1): [good(), good(prompt_tokens=np.array([3, -2], np.int32),
                                               source="poetry", logprobs=nan)],
           ("source", 0): [good(source="poetry"), good(logprobs=nan)]}
  for (field, index), call in calls.items():
    with pytest.raises(TrajectoryValidationError) as err:
      store.writer("u").append(call)
    assert (err.value.field, err.value.index) == (field, index)


def test_error_message_names_value():
  store = TrajectoryStore.create("memory://validation_msg", SCHEMA)
  with pytest.raises(TrajectoryValidationError, match=r"'source' = 'poetry'.*math"):
    store.writer("u").append([good(source="poetry")])
  with pytest.raises(TrajectoryValidationError, match=r"'response_tokens' = 33.*maximum 32"):
    store.writer("u").append([good(response_tokens=np.ones(33, np.int32),
                                   logprobs=np.zeros(33), loss_mask=np.ones(33, bool))])


def test_bad_image_is_refused_with_nothing_written():
  store = TrajectoryStore.create("memory://validation_img", SCHEMA)
  w = store.writer("u")
  img = np.ones((2, 2, 3), np.float32)
  with pytest.raises(TypeError, match="dtype float64"):
    w.append([good(image_ids=(image_id(img),))], images=[img.astype(np.float64)])
  bad = img.copy()
  bad[0, 0, 0] = np.nan
  with pytest.raises(ValueError, match="NaN"):
    w.append([good()], images=[bad])
  assert w.commit.rows == 0 and w.commit.images == 0


def test_schema_validation():
  with pytest.raises(ValueError, match="sources"):
    StoreSchema(sources=("a", "a"))
  with pytest.raises(ValueError, match="token_chunk"):
    StoreSchema(token_chunk=0)
  with pytest.raises(ValueError, match="row_chunk must be a positive int, got True"):
    StoreSchema(row_chunk=True)


def test_chunk_sizes_left_unset_are_chosen_where_the_store_is_created(tmp_path):
  from knittrans_jax.storage.schema import DIRECT_TOKEN_CHUNK, KVSTORE_TOKEN_CHUNK, ROW_CHUNK
  local = TrajectoryStore.create(f"file://{tmp_path}/a", StoreSchema())
  assert (local.schema.token_chunk, local.schema.row_chunk) == (DIRECT_TOKEN_CHUNK, ROW_CHUNK)
  # Whole chunks are read (and crc32c-checked) there: small ones.
  checked = TrajectoryStore.create(f"file://{tmp_path}/b", StoreSchema(payload_checksum=True))
  durable = TrajectoryStore.create(f"file://{tmp_path}/d", StoreSchema(durable=True))
  remote = TrajectoryStore.create("memory://chosen_chunks", StoreSchema())
  assert (checked.schema.token_chunk == durable.schema.token_chunk == remote.schema.token_chunk
          == KVSTORE_TOKEN_CHUNK)
  # An existing store keeps its own; what was set must match it.
  TrajectoryStore.create(f"file://{tmp_path}/c", StoreSchema(token_chunk=64, row_chunk=8))
  again = TrajectoryStore.create(f"file://{tmp_path}/c", StoreSchema())
  assert (again.schema.token_chunk, again.schema.row_chunk) == (64, 8)
  assert TrajectoryStore.open(again.url).schema == again.schema
  with pytest.raises(SchemaMismatchError, match="token_chunk=128"):
    TrajectoryStore.create(f"file://{tmp_path}/c", StoreSchema(token_chunk=128))
  with pytest.raises(ValueError, match="every field set"):
    TrajectoryStore(f"file://{tmp_path}/c", StoreSchema())


@pytest.mark.parametrize("field,value", [("group_id", 2**63), ("index_in_group", np.uint64(2**64 - 1)),
                                         ("versions", (2**70,))])
def test_integers_beyond_int64_are_refused(field, value):
  store = TrajectoryStore.create("memory://validation_int64", SCHEMA)
  with pytest.raises(TrajectoryValidationError, match=f"'{field}'.*2\\*\\*63"):
    store.writer("u").append([good(**{field: value})])


@pytest.mark.parametrize("root", ["memory://", "memory://a//", "memory://x/y"])
def test_roots_with_and_without_paths(root):
  store = TrajectoryStore.create(root, SCHEMA)
  metas = store.writer("u_root").append([good()])
  assert TrajectoryStore.open(root).list_committed("u_root") == metas
