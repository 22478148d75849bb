"""Published weights in Ray's object store: one object per trainer process and version,
found through a named registry actor (WeightSyncConfig.transport = 'ray').

A trainer process `ray.put`s its part of version v once, into the object store of its
own node, and hands the reference to the registry (`knittrans-weights-<work dir tag>`,
created by the driver, so it outlives any trainer actor). Committing v makes it the
registry's latest and drops its references to older versions. A rollout worker asks
the registry for v's references and `ray.get`s them: Ray moves an object to a node once
and keeps one copy there, which every worker on the node maps (numpy arrays come back
as read-only views of the node's object store: no unpickling, no second copy). So each
node receives a version once, however many engines it runs; a version's memory is
freed when the registry has dropped it and no engine holds an array of it (Ray's
reference counting). A part whose writer died (its owner) cannot be fetched: readers
treat it as gone and wait for the rebuilt trainers' next version.

A part is `(index, arrays)`: index rows `[leaf, name, box, dtype, shape]` and one
C-ordered array per piece (dtypes numpy cannot name, bfloat16, travel as raw bytes).
"""
from __future__ import annotations

import numpy as np

from knittrans_jax.rollout.weight_segment import Piece, dtype_of


def registry_name(tag: str) -> str:
  return f"knittrans-weights-{tag}"


class WeightRegistry:
  """The references of each version's parts (a Ray actor; references are kept boxed in
  a list, so Ray passes them through without fetching the objects)."""

  def __init__(self):
    self.parts: dict[int, dict[int, list]] = {}
    self.latest = -1

  def put(self, version: int, part: int, boxed: list) -> None:
    self.parts.setdefault(version, {})[part] = boxed

  def commit(self, version: int, parts: int) -> list[int]:
    """Makes `version` the latest if all its parts are in: the missing parts' numbers."""
    have = self.parts.get(version, {})
    missing = [p for p in range(parts) if p not in have]
    if not missing:
      self.latest = version
      for v in [v for v in self.parts if v < version]:
        del self.parts[v]  # engines that hold its arrays keep them alive
    return missing

  def get(self, version: int) -> list | None:
    """The boxed references of `version`'s parts in part order; None once dropped."""
    have = self.parts.get(version)
    return None if have is None or version != self.latest else [have[p] for p in sorted(have)]

  def clear(self) -> None:
    """A new trainer group starts (resume): what the old one published is forgotten."""
    self.parts, self.latest = {}, -1


def registry(name: str, create: bool):
  """The registry actor `name`: created here (owned by this process and placed on its
  node, so it lives as long as this process) when `create`, else looked up."""
  import ray
  if not ray.is_initialized():
    raise RuntimeError("WeightSyncConfig.transport = 'ray' needs this process connected to "
                       "Ray (JobConfig.cluster = 'ray')")
  if create:  # on this node: it lives as long as this process, not a node that may go
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(WeightRegistry).options(name=name, get_if_exists=True, num_cpus=0,
                                              scheduling_strategy=here).remote()
  try:
    return ray.get_actor(name)
  except ValueError:
    raise RuntimeError(f"no weight registry {name!r} in this Ray namespace: the driver creates "
                       "it (a WeightPublisher of process 0 without a start version) before "
                       "the trainers publish") from None


def _wire(data: np.ndarray) -> np.ndarray:
  data = np.ascontiguousarray(data)
  return data if data.dtype.kind in "biufc" else data.reshape(-1).view(np.uint8)


def put_part(reg, version: int, part: int, pieces) -> None:
  """Puts this process's part of `version` (`pieces`: (leaf, name, box, host array))
  into the object store once and registers it; returns when the registry holds it."""
  import ray
  index, arrays = [], []
  for leaf, name, box, data in pieces:
    index.append([leaf, name, [list(b) for b in box], data.dtype.name, list(data.shape)])
    arrays.append(_wire(data))
  ref = ray.put((index, arrays))
  ray.get(reg.put.remote(version, part, [ref]))


def get_parts(reg, version: int) -> list[list[Piece]] | None:
  """The pieces of each part of `version` (views of this node's object store); None when
  the registry has dropped it or a writer died."""
  import ray
  boxed = ray.get(reg.get.remote(version))
  if boxed is None:
    return None
  try:
    payloads = ray.get([b[0] for b in boxed])
  except ray.exceptions.ObjectLostError:  # its writer (the owner) died: rebuilt trainers republish
    return None
  out = []
  for index, arrays in payloads:
    pieces = []
    for (leaf, name, box, dtype, shape), data in zip(index, arrays):
      dt = dtype_of(dtype)
      if data.dtype != dt:
        data = data.view(dt).reshape(shape)
      pieces.append(Piece(int(leaf), name, tuple(tuple(b) for b in box), data))
    out.append(pieces)
  return out
