"""An array's free pool of reclaimed chunk files (`{array_dir}/free/`), so a run in steady
state writes into pages the file system already holds instead of faulting in fresh
ones (costly tmpfs pages on some VMs: docs/storage.md, "Appends as a unit grows").

`release` (retention's side) moves a reclaimed chunk file into its array's pool;
`FreePool` (the writer's side) takes a file from it for a new chunk, which
file_chunks.replace / write_new rename into place and write over; `drop_pool` deletes
the pool when the writer will append no more.
"""
from __future__ import annotations

import os


class FreePool:
  """The writer's side of an array's free pool (`{array_dir}/free/`, filled by
  `release`): files to take for new chunks. Only the unit's writer takes from it;
  `release` may add to it at any time (from this process or another), so the names
  are listed once (one scandir) and listed again only when the list runs out."""

  def __init__(self, array_dir: str):
    self.dir = os.path.join(array_dir, FREE_DIR)
    self._names: list[str] = []
    self.taken = 0  # files taken, for tests and benchmarks

  def take(self, dst: str) -> bool:
    """Renames a free file to `dst`; False if there is none."""
    for listed in (False, True):
      while self._names:
        src = os.path.join(self.dir, self._names.pop())
        try:
          os.rename(src, dst)
        except FileNotFoundError:
          if not os.path.exists(src):  # gone since it was listed
            continue
          os.makedirs(os.path.dirname(dst), exist_ok=True)  # a new chunk's directory
          os.rename(src, dst)
        self.taken += 1
        return True
      if listed:
        break
      try:
        with os.scandir(self.dir) as entries:
          self._names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
      except FileNotFoundError:  # nothing released yet
        return False
    return False


FREE_DIR = "free"  # an array's reclaimed chunk files, for the writer to reuse


def release(array_dir: str, path: str, recycle: bool) -> bool:
  """Takes a reclaimed chunk file out of its array: into the array's free pool
  (`{array_dir}/free/`, where the unit's writer takes files for new chunks, so a run
  in steady state writes into pages the file system already holds) if `recycle`,
  else deleted. False if there was no such file (reclaimed before)."""
  try:
    if recycle:
      pool = os.path.join(array_dir, FREE_DIR)
      os.makedirs(pool, exist_ok=True)
      os.rename(path, os.path.join(pool, path[len(array_dir):].strip("/").replace("/", "_")))
    else:
      os.unlink(path)
  except FileNotFoundError:
    return False
  return True


def drop_pool(array_dir: str) -> int:
  """Deletes an array's free pool (when its writer will append no more); returns the
  files deleted."""
  pool, done = os.path.join(array_dir, FREE_DIR), 0
  try:
    names = os.listdir(pool)
  except FileNotFoundError:
    return 0
  for name in names:
    try:
      os.unlink(os.path.join(pool, name))
      done += 1
    except FileNotFoundError:
      pass
  return done
