"""Weight sync through the work dir: the trainers publish, workers pick up the newest.

Version v lives in `weights/v{v:08d}/`: each trainer process writes `part{p}.npz`
with the parameter shards its devices hold (replica 0 of each shard only, so every
element is written once across processes, and nothing is gathered or replicated on
the devices to publish). When every part is in place, process 0 replaces
`weights/LATEST`; each file is written under a temporary name and renamed, so a
reader never sees a partial one. A subscriber assembles the full arrays on its
host from the parts. Versions beyond `keep` are removed.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np


def _version_dir(root: str, version: int) -> str:
  return os.path.join(root, f"v{version:08d}")


def _versions(root: str) -> list[int]:
  return sorted(int(d[1:]) for d in os.listdir(root) if d.startswith("v") and d[1:].isdigit())


class WeightPublisher:
  """`version`: the trainer's version at start. Process 0 removes versions above it,
  left by a run that went further before it stopped (resume starts from its last
  checkpoint): the next publish must not be pruned as the oldest."""

  def __init__(self, workdir: str, keep: int = 3, process: int = 0, version: int | None = None):
    self.dir = os.path.join(workdir, "weights")
    os.makedirs(self.dir, exist_ok=True)
    self.keep, self.process = keep, process
    if process == 0 and version is not None:
      for v in _versions(self.dir):
        if v > version:
          shutil.rmtree(_version_dir(self.dir, v), ignore_errors=True)

  def write_part(self, version: int, params) -> str:
    """This process's shards of `params` (device arrays) at `version`."""
    index, arrays = [], {}
    for leaf_id, leaf in enumerate(jax.tree.leaves(params)):
      shape = np.shape(leaf)
      shards = ([s for s in leaf.addressable_shards if s.replica_id == 0]
                if isinstance(leaf, jax.Array) else None)
      if shards is None:  # a host array: all of it
        pieces = [(tuple((0, d) for d in shape), np.asarray(leaf))]
      else:
        pieces = [(tuple((sl.start or 0, d if sl.stop is None else sl.stop)
                         for sl, d in zip(s.index, shape)), np.asarray(s.data)) for s in shards]
      for box, data in pieces:
        arrays[f"a{len(index)}"] = data
        index.append([leaf_id, [list(b) for b in box]])
    folder = _version_dir(self.dir, version)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"part{self.process}.npz")
    tmp = path + ".tmp.npz"
    np.savez(tmp, index=np.array(json.dumps(index)), **arrays)
    os.replace(tmp, path)
    return path

  def commit(self, version: int, parts: int = 1) -> None:
    """(process 0) Every part of `version` is written: make it the latest."""
    folder = _version_dir(self.dir, version)
    missing = [p for p in range(parts) if not os.path.exists(os.path.join(folder, f"part{p}.npz"))]
    if missing:
      raise RuntimeError(f"weights v{version}: parts {missing} of {parts} are missing in {folder}")
    tmp = os.path.join(self.dir, "LATEST.tmp")
    with open(tmp, "w") as f:
      f.write(str(version))
    os.replace(tmp, os.path.join(self.dir, "LATEST"))
    older = [v for v in _versions(self.dir) if v <= version]
    for v in older[:-self.keep]:
      shutil.rmtree(_version_dir(self.dir, v), ignore_errors=True)


class WeightSubscriber:
  """Loads the newest published version into a params tree shaped like `template`."""

  def __init__(self, workdir: str, template):
    self.dir = os.path.join(workdir, "weights")
    self.treedef = jax.tree.structure(template)
    self.specs = [(np.shape(x), np.dtype(x.dtype)) for x in jax.tree.leaves(template)]
    self.version = -1

  def latest_version(self) -> int:
    try:
      with open(os.path.join(self.dir, "LATEST")) as f:
        return int(f.read().strip() or -1)
    except FileNotFoundError:
      return -1

  def poll(self):
    """(version, params) if a newer version exists, else None."""
    v = self.latest_version()
    if v <= self.version:
      return None
    folder = _version_dir(self.dir, v)
    leaves = [np.empty(shape, dtype) for shape, dtype in self.specs]
    filled = [0] * len(leaves)
    try:
      for name in sorted(os.listdir(folder)):
        if not (name.startswith("part") and name.endswith(".npz")) or ".tmp" in name:
          continue
        with np.load(os.path.join(folder, name)) as data:
          for k, (leaf_id, box) in enumerate(json.loads(str(data["index"]))):
            piece = data[f"a{k}"]
            leaves[leaf_id][tuple(slice(a, b) for a, b in box)] = piece
            filled[leaf_id] += piece.size
    except FileNotFoundError:  # already pruned: a newer one is coming
      return None
    short = [k for k, leaf in enumerate(leaves) if filled[k] != leaf.size]
    if short and self.latest_version() != v:
      return None  # pruned while it was read: a newer one is there
    if short:
      raise RuntimeError(f"weights v{v}: leaves {short[:5]} are not fully covered by the "
                         f"parts in {folder}")
    self.version = v
    return v, jax.tree.unflatten(self.treedef, leaves)
