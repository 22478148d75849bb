"""The commit marker: the committed extent of every array of a unit."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import tensorstore as ts

from knittrans_jax.storage import file_chunks
from knittrans_jax.storage import layout as L
from knittrans_jax.storage.errors import CorruptUnitError


@dataclasses.dataclass(frozen=True)
class Commit:
  rows: int = 0
  tokens: int = 0
  refs: int = 0
  images: int = 0
  image_bytes: int = 0
  turns: int = 0  # rows of the `turns` table
  format: int = L.FORMAT_VERSION  # what the unit was written with (layout, image ids)

  def to_array(self) -> np.ndarray:
    out = np.zeros(L.COMMIT_LEN, np.int64)
    out[:7] = (self.format, self.rows, self.tokens, self.refs, self.images, self.image_bytes,
               self.turns)  # fields 0-6 (asserted below); a slice, once per append
    return out


assert (L.C_FORMAT, L.C_ROWS, L.C_TOKENS, L.C_REFS, L.C_IMAGES, L.C_IMAGE_BYTES,
        L.C_TURNS) == tuple(range(7))


READ_ATTEMPTS = 4  # reads of the marker before a failing one is damage


def read_commit(unit: str, array: ts.TensorStore, allow_missing: bool = False) -> Commit:
  """Reads and sanity-checks a unit's commit marker.

  A writer writes a (format, 0, ...) marker before it registers the unit, so an
  all-zero (missing) marker is valid only for a unit that is not registered yet.
  """
  for attempt in range(READ_ATTEMPTS):
    try:
      raw = array.read().result()
      break
    except Exception as e:  # tensorstore raises ValueError subclasses for I/O and codec errors
      # A local writer rewrites the marker in place (write_commit): a read that met
      # the write half done fails its crc32c, and the next read finds it whole.
      if attempt + 1 == READ_ATTEMPTS:
        raise CorruptUnitError(unit, f"commit marker unreadable: {e}") from e
      time.sleep(0.001 * (attempt + 1))
  if not raw.any():
    if allow_missing:
      return Commit()
    raise CorruptUnitError(unit, "commit marker is missing (the unit is registered, so its "
                           "writer had written one)")
  if raw[L.C_FORMAT] not in L.READABLE_FORMATS:
    old = L.LAST_READER_OF.get(int(raw[L.C_FORMAT]))
    readable = ", ".join(map(str, L.READABLE_FORMATS))
    raise CorruptUnitError(unit, f"commit marker format {raw[L.C_FORMAT]} is not one this "
                           f"version reads ({readable})" + (
                               f": an old store; commit {old} of knittrans_jax reads it "
                               "(check it out to read or convert the run)" if old else ""))
  commit = Commit(rows=int(raw[L.C_ROWS]), tokens=int(raw[L.C_TOKENS]), refs=int(raw[L.C_REFS]),
                  images=int(raw[L.C_IMAGES]), image_bytes=int(raw[L.C_IMAGE_BYTES]),
                  turns=int(raw[L.C_TURNS]), format=int(raw[L.C_FORMAT]))
  if min(dataclasses.astuple(commit)) < 0:
    raise CorruptUnitError(unit, f"negative extent in commit marker {commit}")
  return commit


def write_commit(array: ts.TensorStore, commit: Commit, local_dir: str | None = None,
                 in_place: bool = False) -> None:
  """One chunk, one key: kvstore drivers replace it atomically, as the direct write
  to a local unit's `commit` directory does (temporary file, renamed over). With
  `in_place` (a local file system: file_chunks.local_file_system), the marker (68
  bytes with its crc32c) is instead rewritten in place with one `pwrite`, whole or
  not at all to a killed writer; a reader that meets it half written retries
  (read_commit). A quarter of the rename's cost (an inode made and one freed)."""
  if local_dir is None:
    array.write(commit.to_array()).result()
  else:
    path = _PATHS.get(local_dir)
    if path is None:
      path = _PATHS[local_dir] = file_chunks.chunk_path(local_dir + "commit", 0, 1)
    data = commit.to_array()
    if not (in_place and file_chunks.rewrite_small(path, data)):  # new or damaged: whole
      file_chunks.replace(path, data, checksum=True, exchange=file_chunks.exchange_in(local_dir))


_PATHS: dict[str, str] = {}  # a local unit's directory -> its commit marker's file
