"""Local units' payload reads go straight to the chunk files (storage/file_chunks.py)
and return what TensorStore returns."""
import os

import numpy as np
import pytest
from store_helpers import SOURCES, check_payload, group

from knittrans_jax.storage import CorruptUnitError, StoreSchema, TrajectoryStore
from knittrans_jax.storage.file_chunks import ChunkFileError, read_range
from knittrans_jax.storage.unit_reader import UnitReader

SEED, N = 4, 4


@pytest.mark.parametrize("checksum", [False, True])
def test_chunk_file_reads_equal_tensorstore_reads(tmp_path, checksum):
  schema = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=64, row_chunk=8,
                       payload_checksum=checksum)
  store = TrajectoryStore.create(f"file://{tmp_path}/s", schema)
  w = store.writer("u")
  for g in range(5):
    w.append(group(SEED, g, N))
  reader = TrajectoryStore.open(store.url).reader("u")
  total = reader.commit().tokens
  rng = np.random.default_rng(0)
  spans = [(0, total), (0, 1), (63, 65), (64, 128)] + [
      tuple(sorted(rng.integers(0, total, 2))) for _ in range(20)]
  for name in ("tokens", "logprobs", "loss_mask"):
    array = reader.arrays[name]
    for lo, hi in spans:
      got = read_range(str(tmp_path / "s" / "u" / name), 64, array.dtype.numpy_dtype,
                       array.fill_value, int(lo), int(hi), 64 * array.dtype.numpy_dtype.itemsize
                       + 4 * checksum)
      np.testing.assert_array_equal(got, array[lo:hi].read().result())
  # A chunk never written reads as the fill value; one of the wrong size is an error.
  np.testing.assert_array_equal(
      read_range(str(tmp_path / "s" / "u" / "tokens"), 64, np.int32, -1, total + 64,
                 total + 70, 256 + 4 * checksum), -1)
  os.truncate(tmp_path / "s" / "u" / "tokens" / "c" / "1", 100)
  with pytest.raises(ChunkFileError, match=r"tokens/c/1 is 100 bytes, not 2(56|60)"):
    read_range(str(tmp_path / "s" / "u" / "tokens"), 64, np.int32, -1, 0, 200, 256 + 4 * checksum)


def test_a_file_store_reads_its_payload_without_tensorstore(tmp_path, monkeypatch):
  schema = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=64, row_chunk=8)
  store = TrajectoryStore.create(f"file://{tmp_path}/s", schema)
  store.writer("u").append(group(SEED, 0, N))
  fresh = TrajectoryStore.open(store.url)
  metas = fresh.list_committed("u")
  real = UnitReader._read

  def metadata_only(self, name, *args, **kw):
    assert name not in ("tokens", "logprobs", "loss_mask", "images/data"), name
    return real(self, name, *args, **kw)
  monkeypatch.setattr(UnitReader, "_read", metadata_only)
  check_payload(fresh.read(metas).result(), SEED, N)


def _unit(tmp_path, checksum=False):
  schema = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=64, row_chunk=8,
                       payload_checksum=checksum)
  store = TrajectoryStore.create(f"file://{tmp_path}/s", schema)
  store.writer("u").append(group(SEED, 0, N))
  return TrajectoryStore.open(store.url), tmp_path / "s" / "u"


def test_a_longer_chunk_file_is_an_error(tmp_path):
  _, unit = _unit(tmp_path)
  with open(unit / "tokens" / "c" / "1", "ab") as f:
    f.write(b"\0")  # a read to the chunk's end takes no fstat: its byte count tells
  for lo, hi in ((0, 200), (70, 100)):  # to the end of chunk 1, inside it
    with pytest.raises(ChunkFileError, match=r"tokens/c/1 is 257 bytes, not 256"):
      read_range(str(unit / "tokens"), 64, np.int32, -1, lo, hi, 256)


@pytest.mark.parametrize("checksum", [False, True])
def test_a_missing_payload_chunk_is_an_error(tmp_path, checksum):
  store, unit = _unit(tmp_path, checksum)
  metas = store.list_committed("u")
  os.remove(unit / "logprobs" / "c" / "1")
  # Direct reads name the file; TensorStore's (crc32c verified) read the fill value.
  what = "payload chunk missing" if checksum else "logprobs/c/1 is missing"
  with pytest.raises(CorruptUnitError, match=what):
    store.read(metas).result()
