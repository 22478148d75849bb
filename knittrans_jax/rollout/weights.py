"""Weight sync through the work dir: the trainer publishes, workers pick up the newest.

A version is written as `weights/v{version:08d}.npz` (flattened parameter leaves)
to a temporary name and renamed, then `weights/LATEST` is replaced the same way, so
a reader never sees a partial file. Old versions beyond `keep` are removed.
"""
from __future__ import annotations

import os

import jax
import numpy as np


class WeightPublisher:

  def __init__(self, workdir: str, keep: int = 3):
    self.dir = os.path.join(workdir, "weights")
    os.makedirs(self.dir, exist_ok=True)
    self.keep = keep

  def publish(self, version: int, params) -> str:
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(params))]
    path = os.path.join(self.dir, f"v{version:08d}.npz")
    tmp = path + ".tmp.npz"
    np.savez(tmp, *leaves)
    os.replace(tmp, path)
    latest_tmp = os.path.join(self.dir, "LATEST.tmp")
    with open(latest_tmp, "w") as f:
      f.write(str(version))
    os.replace(latest_tmp, os.path.join(self.dir, "LATEST"))
    old = sorted(p for p in os.listdir(self.dir) if p.startswith("v") and p.endswith(".npz"))
    for name in old[:-self.keep]:
      os.remove(os.path.join(self.dir, name))
    return path


class WeightSubscriber:
  """Loads the newest published version into a params tree shaped like `template`."""

  def __init__(self, workdir: str, template):
    self.dir = os.path.join(workdir, "weights")
    self.treedef = jax.tree.structure(template)
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
    try:
      with np.load(os.path.join(self.dir, f"v{v:08d}.npz")) as data:
        leaves = [data[f"arr_{i}"] for i in range(len(data.files))]
    except FileNotFoundError:  # already pruned: a newer one is coming
      return None
    self.version = v
    return v, jax.tree.unflatten(self.treedef, leaves)
