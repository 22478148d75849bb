"""Local units' payload reads go straight to the chunk files (storage/file_chunks.py)
and return what TensorStore returns."""
import os

import numpy as np
import pytest
from store_helpers import SOURCES, check_payload, group

from knittrans_jax.storage import CorruptUnitError, StoreSchema, TrajectoryStore
from knittrans_jax.storage import layout as L
from knittrans_jax.storage.file_chunks import ChunkFileError, read_planes, read_range
from knittrans_jax.storage.unit_reader import UnitReader

SEED, N = 4, 4
DTYPES = [dt for _, dt in L.SEQ_FIELDS]


def _planes_through_tensorstore(array, chunk, lo, hi):
  """Tokens [lo, hi) of a planar array, from whole chunks read by TensorStore."""
  k0, k1 = lo // chunk, -(-hi // chunk)
  raw = array[k0 * chunk * L.SEQ_BYTES:k1 * chunk * L.SEQ_BYTES].read().result()
  raw = raw.reshape(k1 - k0, chunk * L.SEQ_BYTES)
  return [raw[:, o:o + chunk * dt.itemsize].copy().view(dt).reshape(-1)[lo - k0 * chunk:
                                                                         hi - k0 * chunk]
          for o, dt in zip(L.seq_plane_offsets(chunk), DTYPES)]


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
  spans = [(0, total), (0, 1), (63, 65), (64, 128), (0, 64)] + [
      tuple(sorted(rng.integers(0, total, 2))) for _ in range(20)]
  file_bytes = 64 * L.SEQ_BYTES + 4 * checksum
  seq_dir = str(tmp_path / "s" / "u" / "sequences")
  for lo, hi in spans:
    want = _planes_through_tensorstore(reader.arrays["sequences"], 64, int(lo), int(hi))
    got = read_planes(seq_dir, 64, DTYPES, int(lo), int(hi), file_bytes, checksum)
    for g, x in zip(got, want):
      np.testing.assert_array_equal(g, x)
  # The reader's own path (direct, checking crc32c where there is one) agrees as well.
  for lo, hi in spans[:5]:
    for g, x in zip(reader.read_sequences(int(lo), int(hi)).result(),
                    _planes_through_tensorstore(reader.arrays["sequences"], 64, int(lo), int(hi))):
      np.testing.assert_array_equal(g, x)
  if checksum:  # a flipped bit, in a chunk read whole and in one read in part
    path = os.path.join(seq_dir, "c", "0")
    data = bytearray(open(path, "rb").read())
    data[L.seq_plane_offsets(64)[1] + 5] ^= 0x10  # a log-prob's byte
    open(path, "wb").write(bytes(data))
    for lo, hi in ((0, 64), (3, 10), (60, 70)):
      with pytest.raises(ChunkFileError, match="sequences/c/0: crc32c mismatch"):
        read_planes(seq_dir, 64, DTYPES, lo, hi, file_bytes, checksum=True)
    read_planes(seq_dir, 64, DTYPES, 64, 128, file_bytes, checksum=True)  # chunk 1 is fine
    data[L.seq_plane_offsets(64)[1] + 5] ^= 0x10
    open(path, "wb").write(bytes(data))
  os.truncate(os.path.join(seq_dir, "c", "1"), 100)
  for lo, hi in ((0, 200), (70, 100)):  # the whole chunk 1, a part of it
    with pytest.raises(ChunkFileError, match=rf"sequences/c/1 is 100 bytes, not {file_bytes}"):
      read_planes(seq_dir, 64, DTYPES, lo, hi, file_bytes, checksum)


def test_flat_arrays_read_by_range_equal_tensorstore_reads(tmp_path):
  """A 1-D array (the image table's bytes) read by range from its chunk files, chunk
  by chunk, equals TensorStore's read; a chunk never written reads as the fill value,
  one of the wrong size is an error naming the file."""
  import dataclasses
  from knittrans_jax.storage import Image
  schema = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=64, row_chunk=8,
                       image_chunk_bytes=256)
  store = TrajectoryStore.create(f"file://{tmp_path}/s", schema)
  rng = np.random.default_rng(0)
  images = [Image.of(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)) for _ in range(2)]
  trajs = [dataclasses.replace(t, image_ids=(images[i % 2].id,))
           for i, t in enumerate(group(SEED, 0, N))]
  store.writer("u").append(trajs, images=images)
  reader = store.reader("u")
  total = reader.commit().image_bytes
  assert total == 2 * 12 * 12 * 3
  array, d = reader.arrays["images/data"], str(tmp_path / "s" / "u" / "images" / "data")
  for lo, hi in [(0, total), (0, 1), (255, 257), (256, 512)]:
    np.testing.assert_array_equal(read_range(d, 256, np.uint8, 0, lo, hi, 256),
                                  array[lo:hi].read().result())
  np.testing.assert_array_equal(read_range(d, 256, np.uint8, 7, 1024, 1030, 256), 7)
  with open(os.path.join(d, "c", "1"), "ab") as f:
    f.write(b"\0")  # a read to the chunk's end takes no fstat: its byte count tells
  for lo, hi in ((256, 512), (300, 400)):  # to the end of chunk 1, inside it
    with pytest.raises(ChunkFileError, match=r"data/c/1 is 257 bytes, not 256"):
      read_range(d, 256, np.uint8, 0, lo, hi, 256)


def test_a_file_store_reads_its_payload_without_tensorstore(tmp_path, monkeypatch):
  schema = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=64, row_chunk=8)
  store = TrajectoryStore.create(f"file://{tmp_path}/s", schema)
  store.writer("u").append(group(SEED, 0, N))
  fresh = TrajectoryStore.open(store.url)
  metas = fresh.list_committed("u")
  real = UnitReader._read

  def metadata_only(self, name, *args, **kw):
    assert name not in ("sequences", "images/data"), name
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
  with open(unit / "sequences" / "c" / "1", "ab") as f:
    f.write(b"\0")  # a whole-chunk read takes no fstat: its byte count tells
  for lo, hi in ((0, 200), (70, 100)):  # the whole chunk 1, a part of it
    with pytest.raises(ChunkFileError, match=r"sequences/c/1 is 577 bytes, not 576"):
      read_planes(str(unit / "sequences"), 64, DTYPES, lo, hi, 576)


@pytest.mark.parametrize("checksum", [False, True])
def test_a_missing_payload_chunk_is_an_error(tmp_path, checksum):
  store, unit = _unit(tmp_path, checksum)
  metas = store.list_committed("u")
  os.remove(unit / "sequences" / "c" / "1")
  with pytest.raises(CorruptUnitError, match="sequences/c/1 is missing"):
    store.read(metas).result()


def test_the_commit_marker_is_rewritten_in_place_and_a_torn_read_is_read_again(tmp_path):
  """A local writer rewrites its commit marker in place (one pwrite; storage/commit.py):
  the same file across appends, each append visible. A read that meets a marker half
  written (its crc32c fails) is read again; one that stays damaged is an error."""
  from knittrans_jax.storage import commit as C
  store = TrajectoryStore.create(f"file://{tmp_path}/s", StoreSchema(sources=SOURCES,
                                                                      max_response_len=512))
  w = store.writer("u")
  w.append(group(SEED, 0, N))
  path = tmp_path / "s" / "u" / "commit" / "c" / "0"
  inode = os.stat(path).st_ino
  for g in range(1, 4):
    w.append(group(SEED, g, N))
    assert TrajectoryStore.open(store.url).reader("u").commit().rows == (g + 1) * N
  assert os.stat(path).st_ino == inode  # rewritten, not replaced
  reader = TrajectoryStore.open(store.url).reader("u")
  real = reader.arrays["commit"]

  class Torn:  # the first `fail` reads meet the marker half written
    def __init__(self, fail):
      self.fail = fail

    def read(self):
      if self.fail:
        self.fail -= 1
        raise ValueError("crc32c checksum mismatch")
      return real.read()
  assert C.read_commit("u", Torn(C.READ_ATTEMPTS - 1)).rows == 4 * N
  with pytest.raises(CorruptUnitError, match="'u'.*commit marker unreadable"):
    C.read_commit("u", Torn(C.READ_ATTEMPTS))
  # Half of a new marker's bytes, as a read could meet them: damage until the rest lands.
  whole = path.read_bytes()
  new = C.Commit(rows=5 * N, tokens=1, format=L.FORMAT_VERSION).to_array().tobytes()
  path.write_bytes(new[:16] + whole[16:])
  with pytest.raises(CorruptUnitError, match="commit marker unreadable"):
    TrajectoryStore.open(store.url).reader("u").commit()
  # A marker file cut short is replaced whole by the writer's next append.
  path.write_bytes(whole[:10])
  w.append(group(SEED, 4, N))
  assert os.stat(path).st_size == len(whole)
  fresh = TrajectoryStore.open(store.url)
  assert fresh.reader("u").commit().rows == 5 * N
  check_payload(fresh.read(fresh.list_committed("u")).result(), SEED, N)
