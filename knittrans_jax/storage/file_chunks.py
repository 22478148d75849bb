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
is not needed: images, whose content hash is checked on every read, and the payload
without `payload_checksum`. `read_planes` verifies each file's
crc32c when it has one.

Writes (storage/whole_chunks.py decides which): `replace` writes a whole chunk file
(with its crc32c, as the zarr3 `crc32c` codec appends it; from one array or a list
of buffers in file order, e.g. the three planes of a `sequences` chunk) to a
temporary name and renames it over the old one, so a reader sees the old or the
new file, never a mix; `update` writes bytes into an existing chunk file in place,
for bytes past the committed extent only, which no reader reads; `write_new` writes
a chunk that holds no committed byte in place at its own path.

Recycling (storage/chunk_pool.py): `replace` and `write_new` take a new chunk's file
from the array's free pool when given one, written over without O_TRUNC (ftruncate
only if its size differs).
"""
from __future__ import annotations

import ctypes
import errno
import os

import google_crc32c
import numpy as np

from knittrans_jax.storage.chunk_pool import FreePool
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


def _parts_of(data) -> list:
  """The bytes of a chunk: a C-contiguous array, or a list of buffers in file order."""
  if isinstance(data, np.ndarray):
    return [data.reshape(-1).view(np.uint8)]
  return list(data)


def _crc32c(parts: list) -> bytes:
  """The crc32c of the parts' bytes, in order, as the zarr3 `crc32c` codec appends it."""
  crc = 0
  for part in parts:
    frozen = np.frombuffer(part, np.uint8)
    frozen.flags.writeable = False  # what google_crc32c takes without a copy
    crc = google_crc32c.extend(crc, frozen)
  return crc.to_bytes(4, "little")


def rewrite_small(path: str, data: np.ndarray) -> bool:
  """Writes a chunk of at most one page (`data`'s bytes, then their crc32c) over the
  file at `path` in place, with one `pwrite`, if that file exists with the chunk's
  size; False (nothing written) if it does not. One system call of under a page is
  whole or absent to a killed process; a reader may read it half written, which its
  crc32c catches (storage/commit.py reads the marker again then)."""
  raw = data.reshape(-1).view(np.uint8)
  buf = raw.tobytes() + _crc32c([raw])
  if len(buf) > 4096:
    raise ValueError(f"rewrite_small: {len(buf)} bytes is more than a page")
  return update(path, len(buf), [(0, buf)])  # one piece: one pwrite


def replace(path: str, data, checksum: bool, pool: FreePool | None = None,
            exchange: bool = True) -> None:
  """Writes a whole chunk file (a C-contiguous array's bytes, or a list of buffers in
  file order; then their crc32c if `checksum`) atomically: to a temporary file, then
  put in the chunk's place. With `pool`, the temporary file is a free file of the
  array when there is one (written over in place, its pages reused), else a new one.
  `exchange=False` (where `no_writeback`): a plain rename puts it there."""
  tmp = path + ".__knittrans_tmp"
  parts = _parts_of(data)
  if checksum:
    parts.append(_crc32c(parts))
  want = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
  reused = False
  try:
    if pool is not None and pool.take(tmp):
      reused, fd = True, os.open(tmp, os.O_WRONLY)  # no O_TRUNC: its pages are reused
    else:
      try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      except FileNotFoundError:  # the chunk's directory, on a unit's first write to it
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      if os.writev(fd, parts) != want:
        raise ChunkFileError(f"chunk file {tmp}: short write")
      if reused and os.fstat(fd).st_size != want:  # a free file of another size
        os.ftruncate(fd, want)
    finally:
      os.close(fd)
    if exchange:
      _rename_over(tmp, path)
    else:
      os.rename(tmp, path)
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


def _file_system(path: str) -> str:
  """The type of the file system `path` lies on, by /proc/mounts ('' if unknown)."""
  try:
    with open("/proc/mounts") as f:
      mounts = [line.split()[1:3] for line in f]
  except OSError:
    return ""
  path, best = os.path.realpath(path), ("", "")
  for point, fstype in mounts:
    point = point.replace("\\040", " ")
    if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
      best = (point, fstype)
  return best[1]


def local_file_system(path: str) -> bool:
  """Whether `path` lies on a local file system (by /proc/mounts), where a file
  written in place is seen at once by every process. A network file system (NFS)
  may serve another host its cached pages of a file changed in place; a file put in
  place under a new inode is revalidated when opened."""
  return _file_system(path) in _LOCAL_FILE_SYSTEMS


def no_writeback(path: str) -> bool:
  """Whether `path` lies on tmpfs, which never writes a page back: a chunk file is
  replaced there by one plain rename (the exchange, two calls, is for ext4)."""
  return _file_system(path) == "tmpfs"


_EXCHANGE: dict[str, bool] = {}  # directory -> replace(..., exchange=)


def exchange_in(directory: str) -> bool:
  """`replace`'s `exchange` for chunk files under `directory` (asked once per directory)."""
  got = _EXCHANGE.get(directory)
  if got is None:
    got = _EXCHANGE[directory] = not no_writeback(directory)
  return got


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


_FILL: dict[int, memoryview] = {}  # fill value -> bytes of it, grown as needed


def fill_bytes(value: int, n: int) -> memoryview:
  """n bytes of `value` (a shared buffer: read, never written)."""
  have = _FILL.get(value)
  if have is None or len(have) < n:
    have = _FILL[value] = memoryview(np.full(max(n, 1 << 20), value, np.uint8))
  return have[:n]


def write_new(path: str, file_bytes: int, pieces: list[tuple[int, memoryview]], fill: int,
              pool: FreePool | None = None) -> None:
  """Writes a chunk that holds no committed byte (a new chunk) in place, at its own
  path: each (offset, bytes) of `pieces`, in offset order. A file already there of
  the chunk's size (from a failed or killed append) or one taken from `pool` is
  written over in place (its other bytes stay: past the commit, no reader reads
  them); otherwise the file is made whole, `fill` between and after the pieces, as
  TensorStore would leave it. No temporary file: nothing at this path is committed,
  a file cut short by a kill is written whole by the next append, and one whose
  write fails is removed."""
  fresh = False
  try:
    fd = os.open(path, os.O_WRONLY)
  except FileNotFoundError:
    if pool is not None and pool.take(path):
      fd = os.open(path, os.O_WRONLY)  # no O_TRUNC: its pages are what we reuse
    else:
      fresh = True
      try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
      except FileNotFoundError:  # the chunk's directory, on a unit's first write to it
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    try:
      if not fresh and os.fstat(fd).st_size != file_bytes:
        fresh = True  # cut short or foreign: made whole below
        os.ftruncate(fd, file_bytes)
      if fresh:  # one writev of the whole file
        parts, at = [], 0
        for offset, data in pieces:
          if offset > at:
            parts.append(fill_bytes(fill, offset - at))
          parts.append(data)
          at = offset + len(data)
        if at < file_bytes:
          parts.append(fill_bytes(fill, file_bytes - at))
        if os.pwritev(fd, parts, 0) != file_bytes:
          raise ChunkFileError(f"chunk file {path}: short write")
      else:
        for offset, data in pieces:
          if os.pwrite(fd, data, offset) != len(data):
            raise ChunkFileError(f"chunk file {path}: short write at {offset}")
    finally:
      os.close(fd)
  except BaseException:
    try:  # it holds nothing committed; it must not hold space (a full disk) either
      os.unlink(path)
    except OSError:
      pass
    raise
