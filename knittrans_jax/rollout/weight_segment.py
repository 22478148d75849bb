"""One shared-memory segment of published weights: a file on a tmpfs (/dev/shm) that a
trainer process writes once and every rollout worker on the host maps.

Layout (little-endian):
  bytes 0-7     magic b"KTWSEG01"
  bytes 8-15    header length H (uint64)
  bytes 16-19   crc32c of the header's H bytes (uint32)
  bytes 64..    the header: JSON {version, part, data_offset, data_bytes, data_crc32c,
                pieces: [{leaf, name, box, dtype, shape, offset}]}
  data_offset.. the pieces' raw bytes, each C-ordered at a 64-byte aligned offset
                (relative to data_offset, a multiple of 4096), zeros between them.
A piece is a box of one leaf (the whole leaf when the writer held all of it). The
writer fills a temporary file and renames it, so the final name never holds a partial
segment; a reader still checks the size, both checksums and every piece's bounds, so a
damaged or truncated file is an error naming the file and the field, never wrong weights.
Readers map the file copy-on-write: pieces are numpy views of the page cache (no read,
no unpickling), and a stray write stays private to the process that made it. A reader
holds a shared flock on the file for as long as it maps it: a writer's SegmentPool
reuses a retired segment only when it can lock it exclusively.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import mmap
import os
import struct
import weakref
from typing import Callable

import google_crc32c
import ml_dtypes
import numpy as np

MAGIC = b"KTWSEG01"
_PREFIX = struct.Struct("<8sQI")
HEADER_AT = 64
ALIGN = 64  # XLA's CPU client aliases host buffers at this alignment (no copy on device_put)
PAGE = 4096


class SegmentError(ValueError):
  """A segment that cannot be read as published weights (the message names why)."""


@dataclasses.dataclass(frozen=True)
class Piece:
  leaf: int  # the leaf's index in the params tree's leaves
  name: str  # the leaf's tree path (jax.tree_util.keystr)
  box: tuple[tuple[int, int], ...]  # [start, stop) per dimension of the full leaf
  data: np.ndarray  # a view of the segment


def dtype_of(name: str) -> np.dtype:
  """A piece's dtype by name, bfloat16 included (ml_dtypes, as JAX names it): this
  module loads no JAX, so a vLLM worker reads segments without it."""
  extra = getattr(ml_dtypes, name, None)
  return np.dtype(extra if isinstance(extra, type) else name)


def _round(n: int, to: int) -> int:
  return -(-n // to) * to


def _crc(view) -> int:
  frozen = np.frombuffer(view, np.uint8)
  frozen.flags.writeable = False  # what google_crc32c takes without a copy
  return google_crc32c.value(frozen) if frozen.size else 0


@dataclasses.dataclass(frozen=True)
class PieceOut:
  """A piece to write: `fill(dst)` writes its values into `dst`, a C-ordered view of
  the segment with `dtype` and `shape`."""
  leaf: int
  name: str
  box: tuple[tuple[int, int], ...]
  dtype: np.dtype
  shape: tuple[int, ...]
  fill: Callable[[np.ndarray], None]


def _layout(version: int, part: int, pieces: list[PieceOut]) -> tuple[dict, int]:
  """(the header without its data crc, the file's size) of a segment of `pieces`."""
  entries, offset = [], 0
  for p in pieces:
    nbytes = int(np.prod(p.shape, dtype=np.int64)) * np.dtype(p.dtype).itemsize
    entries.append({"leaf": p.leaf, "name": p.name, "box": [list(b) for b in p.box],
                    "dtype": np.dtype(p.dtype).name, "shape": list(p.shape),
                    "offset": offset})
    offset = _round(offset + nbytes, ALIGN)
  head = {"version": version, "part": part, "data_bytes": offset, "pieces": entries}
  # The data starts after the header; the header's length does not depend on the crc's
  # digits once it is padded to a page.
  head["data_offset"] = _round(HEADER_AT + len(json.dumps({**head, "data_crc32c": 2**32 - 1}))
                               + 32, PAGE)
  return head, head["data_offset"] + offset


def _fill(mm: mmap.mmap, head: dict, pieces: list[PieceOut], checksum: bool) -> None:
  """Writes `pieces` and then the header into `mm`, a writable mapping of the file."""
  data_offset = head["data_offset"]
  for e, p in zip(head["pieces"], pieces):
    dst = np.frombuffer(mm, dtype_of(e["dtype"]), int(np.prod(e["shape"])),
                        data_offset + e["offset"]).reshape(e["shape"])
    p.fill(dst)
    del dst  # mm closes only once no view of it is left
  data = memoryview(mm)[data_offset:]
  head["data_crc32c"] = _crc(data) if checksum else None
  data.release()
  text = json.dumps(head).encode()
  mm[:_PREFIX.size] = _PREFIX.pack(MAGIC, len(text), _crc(text))
  mm[HEADER_AT:HEADER_AT + len(text)] = text


def _allocate(path: str, size: int, full_hint: str) -> tuple[int, mmap.mmap]:
  """(fd, a shared writable mapping) of a new `size`-byte file at `path`."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
  try:  # reserved now: a full tmpfs is an error here, not a SIGBUS while writing
    os.posix_fallocate(fd, 0, size)
    return fd, mmap.mmap(fd, size)
  except OSError as e:
    os.close(fd)
    os.unlink(path)
    raise OSError(e.errno, f"weight segment {path}: no room for {size} bytes in "
                  f"{os.path.dirname(path)} ({e.strerror}); free it {full_hint}") from None


def write_segment(path: str, version: int, part: int, pieces: list[PieceOut],
                  checksum: bool = True,
                  full_hint: str = "or set WeightSyncConfig.transport = 'files'") -> int:
  """Writes `pieces` to `path` (through a temporary name); returns the bytes written.
  `checksum=False`: no crc32c of the data (a pass over the bytes), for a segment its
  reader maps moments later on the same host (data_crc32c null: nothing to verify)."""
  head, size = _layout(version, part, pieces)
  tmp = f"{path}.tmp{os.getpid()}"
  fd, mm = _allocate(tmp, size, full_hint)
  os.close(fd)
  try:
    _fill(mm, head, pieces, checksum)
  finally:
    mm.close()
  os.replace(tmp, path)  # whole, or not there
  return size


@dataclasses.dataclass
class _Held:
  path: str  # its name now: a version's, or a spare's
  fd: int
  mm: mmap.mmap
  size: int


class SegmentPool:
  """One writer's segments, each kept open and mapped, so the next versions are written
  into retired ones: no allocation and no page faults (on a 0.5B model's 2 GB these are
  most of a fresh segment's cost; the copy itself is a fraction).

  A retired segment is first renamed to a spare's name, so no reader can open it any
  more; it is overwritten only while this writer holds an exclusive flock on it, which
  fails while any reader still maps it (read_segment holds a shared flock on the fd it
  keeps for as long as its mapping lives). A reader that opened the old name just before
  the rename finds, once it has its lock, that the name no longer leads to the file it
  opened, and treats it as released (FileNotFoundError), as it would an unlinked one.
  At most `spares` retired segments are kept, the oldest unlinked first (their memory
  goes when their last reader lets go); one whose size differs from the next version's
  is never written into."""

  def __init__(self, spares: int, spare_name: Callable[[int], str],
               full_hint: str = "or set WeightSyncConfig.transport = 'files'"):
    self.spares, self.spare_name, self.full_hint = spares, spare_name, full_hint
    self._live: dict[str, _Held] = {}
    self._spare: list[_Held] = []
    self._count = 0
    self.reused = 0  # segments written into a retired one (for tests and benchmarks)

  def live(self) -> list[str]:
    return list(self._live)

  def retire(self, path: str) -> None:
    """`path` (written by this pool) is no longer named by LATEST: keep it as a spare."""
    held = self._live.pop(path)
    spare = self.spare_name(self._count)
    self._count += 1
    try:
      os.rename(path, spare)
    except FileNotFoundError:  # unlinked by someone else (a trainer's cleanup)
      self._drop(held, unlink=False)
      return
    held.path = spare
    self._spare.append(held)

  def write(self, path: str, version: int, part: int, pieces: list[PieceOut],
            checksum: bool = True) -> int:
    """As write_segment, into a spare that no reader maps where there is one."""
    head, size = _layout(version, part, pieces)
    held = self._take(size)
    if held is None:
      tmp = f"{path}.tmp{os.getpid()}"
      try:
        fd, mm = _allocate(tmp, size, self.full_hint)
      except OSError as e:
        if e.errno != errno.ENOSPC or not self._spare:
          raise
        self.trim(0)  # room taken by spares readers still map: theirs to free, not ours
        fd, mm = _allocate(tmp, size, self.full_hint)
      held = _Held(tmp, fd, mm, size)
    else:
      self.reused += 1
    try:
      _fill(held.mm, head, pieces, checksum)
      os.replace(held.path, path)  # whole, or not there
    except BaseException:
      self._drop(held, unlink=True)  # its lock goes with its fd
      raise
    fcntl.flock(held.fd, fcntl.LOCK_UN)
    held.path = path
    self._live[path] = held
    self.trim(self.spares)
    return size

  def _take(self, size: int) -> _Held | None:
    """A spare of `size` bytes, exclusively locked, or None."""
    for held in self._spare:
      if held.size != size:
        continue
      try:
        fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:  # a reader maps it
        continue
      self._spare.remove(held)
      return held
    return None

  def trim(self, keep: int) -> None:
    """Unlinks all but the newest `keep` spares."""
    while len(self._spare) > keep:
      self._drop(self._spare.pop(0), unlink=True)

  def _drop(self, held: _Held, unlink: bool) -> None:
    if unlink:
      try:
        os.unlink(held.path)
      except FileNotFoundError:
        pass
    held.mm.close()
    os.close(held.fd)

  def close(self) -> None:
    """Lets go of every file (names are the caller's to unlink)."""
    for held in [*self._live.values(), *self._spare]:
      self._drop(held, unlink=False)
    self._live, self._spare = {}, []


def read_segment(path: str, verify: bool = True) -> tuple[dict, list[Piece]]:
  """(header, pieces as views of the mapped file); FileNotFoundError if `path` is not
  there, SegmentError if it is not a whole, undamaged segment. `verify`: check the
  data's crc32c too (one pass over the bytes), where the writer stored one."""
  fd = os.open(path, os.O_RDONLY)
  try:
    # Held while the mapping lives: a writer's pool overwrites only files nobody locks.
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # a pool is overwriting it: retired, renamed away
      raise FileNotFoundError(errno.ENOENT, "weight segment retired", path) from None
    st = os.fstat(fd)
    if os.stat(path).st_ino != st.st_ino:  # retired (and reused) between open and lock
      raise FileNotFoundError(errno.ENOENT, "weight segment retired", path)
    size = st.st_size
    if size < HEADER_AT:
      raise SegmentError(f"weight segment {path}: truncated: {size} bytes, less than the "
                         f"{HEADER_AT}-byte prefix")
    mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    head, pieces = _parse(path, mm, size, verify)
  except BaseException:
    os.close(fd)
    raise
  _remember(mm, fd, path)
  return head, pieces


def _parse(path: str, mm: mmap.mmap, size: int, verify: bool) -> tuple[dict, list[Piece]]:
  magic, length, crc = _PREFIX.unpack_from(mm, 0)
  if magic != MAGIC:
    raise SegmentError(f"weight segment {path}: magic {magic!r}, expected {MAGIC!r}")
  if HEADER_AT + length > size:
    raise SegmentError(f"weight segment {path}: truncated: {size} bytes, the header alone "
                       f"ends at {HEADER_AT + length}")
  text = mm[HEADER_AT:HEADER_AT + length]
  if _crc(text) != crc:
    raise SegmentError(f"weight segment {path}: header crc32c {_crc(text):#010x}, stored "
                       f"{crc:#010x} (damaged)")
  head = json.loads(text)
  end = head["data_offset"] + head["data_bytes"]
  if size != end:
    raise SegmentError(f"weight segment {path}: truncated: {size} bytes, its header says {end}")
  if verify and head["data_crc32c"] is not None:
    data = memoryview(mm)[head["data_offset"]:]
    got = _crc(data)
    data.release()
    if got != head["data_crc32c"]:
      raise SegmentError(f"weight segment {path}: data crc32c {got:#010x}, stored "
                         f"{head['data_crc32c']:#010x} (damaged)")
  pieces = []
  for e in head["pieces"]:
    dtype, shape = dtype_of(e["dtype"]), tuple(e["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if e["offset"] + count * dtype.itemsize > head["data_bytes"]:
      raise SegmentError(f"weight segment {path}: piece {e['name']} ends past the data")
    data = np.frombuffer(mm, dtype, count, head["data_offset"] + e["offset"]).reshape(shape)
    pieces.append(Piece(e["leaf"], e["name"], tuple(tuple(b) for b in e["box"]), data))
  return head, pieces


# Segments this process maps, by the address of their first byte: (end, fd, path). The
# file stays open while its mapping lives, so another process on the host reaches the
# same file as /proc/PID/fd/FD even after a newer version unlinked its name.
_MAPPED: dict[int, tuple[int, int, str]] = {}


def _remember(mm: mmap.mmap, fd: int, path: str) -> None:
  start = np.frombuffer(mm, np.uint8).ctypes.data
  _MAPPED[start] = (start + len(mm), fd, path)
  weakref.finalize(mm, _forget, start, fd)


def _forget(start: int, fd: int) -> None:
  _MAPPED.pop(start, None)
  os.close(fd)


def file_of(array: np.ndarray) -> tuple[str, int] | None:
  """Where a view of a segment this process maps lies: (a path to that file any process
  of this host's user can open, the byte offset of the view's first element), or None
  if `array` is not wholly inside one."""
  lo, hi = np.lib.array_utils.byte_bounds(array)
  for start, (end, fd, _) in list(_MAPPED.items()):
    if start <= lo and hi <= end:
      return f"/proc/{os.getpid()}/fd/{fd}", array.__array_interface__["data"][0] - start
  return None
