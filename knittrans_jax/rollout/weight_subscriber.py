"""The reading side of weight sync: a rollout worker loads the newest published version
(rollout/weights.py publishes it) into a params tree, from shared-memory segments, files
or the Ray object store, checking that every leaf is covered."""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from knittrans_jax.rollout import weight_objects
from knittrans_jax.rollout.weight_segment import SegmentError, read_segment
from knittrans_jax.rollout.weights import read_latest, version_dir


class WeightSyncError(RuntimeError):
  """Published weights that cannot be loaded into the model (the message names why)."""


class WeightSubscriber:
  """Loads the newest published version (either transport) into a params tree shaped
  like `template` (give wire_template(template, dtype) when the publisher casts).
  Segment leaves are zero-copy views of the mapping where a segment holds the whole
  leaf; `verify`: check each segment's data crc32c."""

  def __init__(self, workdir: str, template, verify: bool = True):
    self.dir = os.path.join(workdir, "weights")
    flat, self.treedef = jax.tree_util.tree_flatten_with_path(template)
    self.names = [jax.tree_util.keystr(p) for p, _ in flat]
    self.specs = [(tuple(np.shape(x)), np.dtype(x.dtype)) for _, x in flat]
    self.verify = verify
    self.version = -1
    self._registry = None  # ('ray': (name, actor handle))

  def latest_version(self) -> int:
    return read_latest(self.dir)[0]

  def poll(self):
    """(version, params) if a newer version exists, else None."""
    v, where = read_latest(self.dir)
    if v <= self.version:
      return None
    if where is None:
      leaves = self._from_files(v)
    elif "ray" in where:
      leaves = self._from_ray(v, where["ray"])
    else:
      leaves = self._from_segments(v, where["segments"])
    if leaves is None:
      return None
    self.version = v
    return v, jax.tree.unflatten(self.treedef, leaves)

  def _from_segments(self, v: int, paths: list[str]):
    try:
      read = [(path, *read_segment(path, self.verify)) for path in paths]
    except FileNotFoundError as e:
      if self.latest_version() != v:
        return None  # released by a newer commit while this one was read
      raise WeightSyncError(
          f"weights v{v}: segment {e.filename}, named by {self.dir}/LATEST, is not there: is "
          "this worker on another host than the trainer (a Ray cluster's transport, "
          "'ray', serves that), or was the host's /dev/shm cleared?") from None
    for path, head, _ in read:
      if head["version"] != v:
        raise SegmentError(f"weight segment {path}: version {head['version']}, LATEST says {v}")
    return self._assemble(v, [(path, pieces) for path, _, pieces in read])

  def _from_ray(self, v: int, name: str):
    if self._registry is None or self._registry[0] != name:
      self._registry = (name, weight_objects.registry(name, create=False))
    parts = weight_objects.get_parts(self._registry[1], v)
    if parts is None:
      return None  # dropped for a newer version, or its writer died: a newer one comes
    return self._assemble(v, [(f"ray:{name}/v{v}/p{k}", p) for k, p in enumerate(parts)])

  def _assemble(self, v: int, parts):
    """The leaves from each part's pieces: a piece that is the whole leaf as it is (a
    view, no copy), smaller ones copied into place."""
    leaves: list = [None] * len(self.specs)
    filled = [0] * len(self.specs)
    for path, pieces in parts:
      for p in pieces:
        shape, dtype = self._check(v, path, p.leaf, p.name, p.box, p.data)
        if p.data.shape == shape:
          leaves[p.leaf] = p.data  # the whole leaf: a view of the mapping, no copy
        else:
          if leaves[p.leaf] is None:
            leaves[p.leaf] = np.empty(shape, dtype)
          leaves[p.leaf][tuple(slice(a, b) for a, b in p.box)] = p.data
        filled[p.leaf] += p.data.size
    self._check_covered(v, leaves, filled, parts[0][0])
    return leaves

  def _check(self, v: int, path: str, leaf: int, name: str, box, data):
    where = f"weights v{v} ({path})"
    if not 0 <= leaf < len(self.specs):
      raise WeightSyncError(f"{where}: leaf index {leaf} ({name}), the model has "
                            f"{len(self.specs)} leaves")
    shape, dtype = self.specs[leaf]
    if name != self.names[leaf]:
      raise WeightSyncError(f"{where}: leaf {leaf} is {name}, the model's is {self.names[leaf]}")
    if data.dtype != dtype:
      raise WeightSyncError(f"{where}: leaf {name}: dtype {data.dtype}, the model's {dtype} "
                            "(WeightSyncConfig.dtype must agree on both sides)")
    if len(box) != len(shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(box, shape)) \
        or tuple(b - a for a, b in box) != data.shape:
      raise WeightSyncError(f"{where}: leaf {name}: a piece of shape {data.shape} at "
                            f"{[list(b) for b in box]} does not fit the model's shape {shape}")
    return shape, dtype

  def _check_covered(self, v: int, leaves, filled, where: str) -> None:
    short = [self.names[k] for k, (s, _) in enumerate(self.specs)
             if filled[k] != int(np.prod(s, dtype=np.int64))]
    if short:
      raise WeightSyncError(f"weights v{v}: leaves {short[:5]} are not fully covered by the "
                            f"parts at {where}")

  def _from_files(self, v: int):
    folder = version_dir(self.dir, v)
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
    try:
      self._check_covered(v, leaves, filled, folder)
    except WeightSyncError:
      if self.latest_version() != v:
        return None  # pruned while it was read: a newer one is there
      raise
    return leaves
