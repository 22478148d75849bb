"""Reads and writes the chunk files of a `file://` unit directly, without
TensorStore's kvstore (whose file driver writes every chunk as a lock file plus a
rename, a fixed cost per chunk even for the 68-byte commit marker: docs/storage.md).

Reads: a range of a 1-D zarr3 array straight from its chunk files into one fresh
buffer: one copy, from the page cache into the result. A range of tokens of the
planar `sequences` array (storage/layout.py) is read the same way, each plane into
its own buffer.

Through TensorStore the same read copies each chunk into a buffer of its own, decodes
it into another and copies that into the result, on its thread pools; this is the
read path for local units whose chunks are plain bytes (the `bytes` codec, with or
without a trailing crc32c). It keeps TensorStore's meaning of the files: chunk
`c/K` of the default key encoding, a missing chunk reads as the fill value (or is
an error naming the file, for payload reads), and a chunk file whose size is not the
chunk's is an error (a truncated or foreign file).
`read_range` does not verify a chunk's crc32c, so callers use it where the checksum
is not needed: images, whose content hash is checked on every read, and the arrays
of format 1-2 units without `payload_checksum`. `read_planes` verifies each file's
crc32c when it has one.

Writes (storage/whole_chunks.py decides which): `replace` writes a whole chunk file
(with its crc32c, as the zarr3 `crc32c` codec appends it) to a temporary name and
renames it over the old one, so a reader sees the old or the new file, never a
mix; `update` writes bytes into an existing chunk file in place, for bytes past the
committed extent only, which no reader reads.
"""
from __future__ import annotations

import ctypes
import errno
import os

import google_crc32c
import numpy as np

from knittrans_jax.storage.errors import StoreError

_PREFIX = "file://"


def local_path(url: str) -> str | None:
  """The directory of a `file://` URL (None for any other kvstore)."""
  return url[len(_PREFIX):] if url.startswith(_PREFIX) else None


class ChunkFileError(StoreError):
  """A chunk file that cannot hold what the array says it holds."""


def read_range(array_dir: str, chunk: int, dtype: np.dtype, fill, start: int, stop: int,
               file_bytes: int) -> np.ndarray:
  """Elements [start, stop) of the 1-D array at `array_dir` (chunks of `chunk`
  elements, each file `file_bytes` long: the chunk's bytes plus any checksum). A
  missing chunk reads as `fill`, or is an error naming its file when `fill` is None."""
  dtype = np.dtype(dtype)
  out = np.empty(stop - start, dtype)
  raw = memoryview(out.view(np.uint8))
  size = dtype.itemsize
  prefix = os.path.join(array_dir, "c", "")
  # A read that runs to its chunk's end also reads the rest of the file and one byte
  # past it: the byte count then tells a short or a long file without an fstat.
  tail = bytearray(file_bytes - chunk * size + 1)
  for k in range(start // chunk, -(-stop // chunk)):
    lo, hi = max(start, k * chunk), min(stop, (k + 1) * chunk)
    dst = raw[(lo - start) * size:(hi - start) * size]
    path = prefix + str(k)
    try:
      fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
      if fill is None:
        raise ChunkFileError(f"chunk file {path} is missing") from None
      out[lo - start:hi - start] = fill  # as TensorStore reads a chunk never written
      continue
    try:
      to_end = hi == (k + 1) * chunk
      if not to_end:
        _check_size(fd, path, file_bytes)
      want = len(dst) + (len(tail) - 1 if to_end else 0)
      got = os.preadv(fd, [dst, tail] if to_end else [dst], (lo - k * chunk) * size)
      _check_read(fd, path, got, want, file_bytes)
    finally:
      os.close(fd)
  return out


def _check_read(fd: int, path: str, got: int, want: int, file_bytes: int) -> None:
  if got != want:
    _check_size(fd, path, file_bytes)  # names the size when it is the size
    raise ChunkFileError(f"chunk file {path}: read {got} of {want} bytes")


def _check_size(fd: int, path: str, file_bytes: int) -> None:
  have = os.fstat(fd).st_size
  if have != file_bytes:
    raise ChunkFileError(f"chunk file {path} is {have} bytes, not {file_bytes}")


def read_planes(array_dir: str, chunk: int, dtypes: list[np.dtype], start: int, stop: int,
                file_bytes: int, checksum: bool = False) -> list[np.ndarray]:
  """Tokens [start, stop) of a planar array whose chunk files hold `chunk` tokens as
  one plane per dtype, in order: one array per plane. With `checksum` each file
  ends in the crc32c of its planes, checked here (a chunk read in part is read whole
  for it). A missing chunk file is an error naming it."""
  outs = [np.empty(stop - start, dt) for dt in dtypes]
  raws = [memoryview(o.view(np.uint8)) for o in outs]
  sizes = [np.dtype(dt).itemsize for dt in dtypes]
  offsets = np.cumsum([0] + [chunk * z for z in sizes]).tolist()
  planes_bytes = offsets.pop()
  prefix = os.path.join(array_dir, "c", "")
  tail = bytearray(file_bytes - planes_bytes + 1)
  for k in range(start // chunk, -(-stop // chunk)):
    lo, hi = max(start, k * chunk), min(stop, (k + 1) * chunk)
    a, b = lo - start, hi - start
    path = prefix + str(k)
    try:
      fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
      raise ChunkFileError(f"chunk file {path} is missing") from None
    try:
      if hi - lo == chunk:
        # The whole file in one call, straight into the planes; the byte past the
        # file's end tells a short or a long file without an fstat.
        bufs = [r[a * z:b * z] for r, z in zip(raws, sizes)] + [tail]
        got, want = os.preadv(fd, bufs, 0), file_bytes
        if got == want and checksum:
          _check_crc(path, [o[a:b] for o in outs], tail[:4])
      elif checksum:  # the whole file, to check it, then the part asked for
        whole = np.empty(file_bytes + 1, np.uint8)
        got, want = os.preadv(fd, [whole], 0), file_bytes
        if got == want:
          _check_crc(path, [whole[:planes_bytes]], whole[planes_bytes:file_bytes].tobytes())
          at = lo - k * chunk
          for r, z, o in zip(raws, sizes, offsets):
            r[a * z:b * z] = whole[o + at * z:o + (at + b - a) * z]
      else:
        _check_size(fd, path, file_bytes)
        got = want = 0
        for r, z, o in zip(raws, sizes, offsets):
          want += (b - a) * z
          got += os.preadv(fd, [r[a * z:b * z]], o + (lo - k * chunk) * z)
      _check_read(fd, path, got, want, file_bytes)
    finally:
      os.close(fd)
  return outs


def _check_crc(path: str, parts: list[np.ndarray], stored) -> None:
  """The crc32c of the parts' bytes, in order, against the 4 bytes stored after them."""
  crc = 0
  for part in parts:
    frozen = part.view(np.uint8)
    frozen.flags.writeable = False  # what google_crc32c takes without a copy
    crc = google_crc32c.extend(crc, frozen)
  if crc != int.from_bytes(bytes(stored), "little"):
    raise ChunkFileError(f"chunk file {path}: crc32c mismatch (its bytes are damaged)")


def chunk_path(array_dir: str, index: int, ndim: int) -> str:
  """The file of chunk `index` along axis 0 (the default key encoding; arrays of more
  dimensions hold all of their other axes in one chunk)."""
  return os.path.join(array_dir, "c", str(index), *["0"] * (ndim - 1))


def replace(path: str, data: np.ndarray, checksum: bool) -> None:
  """Writes a whole chunk file (a C-contiguous array's bytes, then its crc32c if
  `checksum`) atomically: to a temporary file, then put in the chunk's place."""
  tmp = path + ".__knittrans_tmp"
  try:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  except FileNotFoundError:  # the chunk's directory, on a unit's first write to it
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  try:
    try:
      raw = data.reshape(-1).view(np.uint8)
      parts = [raw]
      if checksum:
        frozen = raw.view()
        frozen.flags.writeable = False  # what google_crc32c takes without a copy
        parts.append(google_crc32c.value(frozen).to_bytes(4, "little"))
      want = sum(len(p) for p in parts)
      if os.writev(fd, parts) != want:
        raise ChunkFileError(f"chunk file {tmp}: short write")
    finally:
      os.close(fd)
    _rename_over(tmp, path)
  except BaseException:
    try:  # a partial file must not hold space (a full disk) after the failure
      os.unlink(tmp)
    except OSError:
      pass
    raise


# ext4 (its default auto_da_alloc) starts writeback of a file renamed over another,
# a synchronous cost per chunk (docs/storage.md); exchanging the two names (renameat2 RENAME_EXCHANGE) and
# removing the old file does not, and a reader still finds one whole file at `path`
# (a process killed in between leaves the old file under the temporary name).
_LIBC = ctypes.CDLL(None, use_errno=True)
_RENAMEAT2 = getattr(_LIBC, "renameat2", None)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
# Kernels, file systems (NFS) or sandboxes (seccomp: EPERM) without the exchange.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM}


def _rename_over(tmp: str, path: str) -> None:
  global _RENAMEAT2
  if _RENAMEAT2 is not None:
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(path), _RENAME_EXCHANGE) == 0:
      os.unlink(tmp)  # the old file, now under the temporary name
      return
    if ctypes.get_errno() in _NO_EXCHANGE:  # plain renames from now on
      _RENAMEAT2 = None
  # No file at `path` yet (ENOENT), or no exchange: a rename, which raises any real error.
  os.rename(tmp, path)


_LOCAL_FILE_SYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs", "zfs", "overlay"}


def local_file_system(path: str) -> bool:
  """Whether `path` lies on a local file system (by /proc/mounts), where a file
  written in place is seen at once by every process. A network file system (NFS)
  may serve another host its cached pages of a file changed in place; a file put in
  place under a new inode is revalidated when opened."""
  try:
    with open("/proc/mounts") as f:
      mounts = [line.split()[1:3] for line in f]
  except OSError:
    return False
  path, best = os.path.realpath(path), ("", "")
  for point, fstype in mounts:
    point = point.replace("\\040", " ")
    if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
      best = (point, fstype)
  return best[1] in _LOCAL_FILE_SYSTEMS


def update(path: str, file_bytes: int, pieces: list[tuple[int, memoryview]]) -> bool:
  """Writes each (offset, bytes) of `pieces` into the chunk file in place, if it
  exists with the size of a whole chunk; False (nothing written) if it does not."""
  try:
    fd = os.open(path, os.O_WRONLY)
  except FileNotFoundError:
    return False
  try:
    if os.fstat(fd).st_size != file_bytes:
      return False
    for offset, data in pieces:
      if os.pwrite(fd, data, offset) != len(data):
        raise ChunkFileError(f"chunk file {path}: short write at {offset}")
  finally:
    os.close(fd)
  return True
