"""Device mesh and logical-to-mesh sharding rules (MaxText-style), from gin.

A layout is a whole gin file (configs/mesh/*.gin): the mesh axes and the rules
that map the models' logical axes ('batch', 'vocab', 'embed', 'heads', 'mlp',
'patch') to them. Rules apply in order; a mesh axis already used by a tensor is
skipped; a logical axis without a rule is replicated.

Below models/, rl/ and train/ (all three place arrays by these rules), so none of
them imports another for it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Sequence

import gin
import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """axes: (name, size) pairs; one size may be -1 (all remaining devices)."""
  axes: Sequence[tuple[str, int]] = (("data", -1),)
  rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = (("batch", "data"),)
  name: str = "dp"

  def shape(self, num_devices: int) -> tuple[int, ...]:
    sizes = [s for _, s in self.axes]
    fixed = math.prod(s for s in sizes if s != -1)
    if sizes.count(-1) > 1 or num_devices % fixed:
      raise ValueError(f"mesh axes {list(self.axes)} do not fit {num_devices} devices")
    return tuple(num_devices // fixed if s == -1 else s for s in sizes)


def make_mesh(config: MeshConfig, devices=None) -> Mesh:
  devices = devices if devices is not None else jax.devices()
  shape = config.shape(len(devices))
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh {dict(zip([a for a, _ in config.axes], shape))} needs "
                     f"{math.prod(shape)} devices, {len(devices)} given")
  names = tuple(a for a, _ in config.axes)
  # Auto axes: GSPMD propagates shardings through the model (MaxText style).
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                       devices=devices)


def mesh_or_default(mesh=None, rules=None) -> tuple[Mesh, Sequence]:
  """(mesh, rules) as given, or the gin MeshConfig's over all devices when `mesh` is
  None (`rules` given alone still win): what the checkpoint loaders default to."""
  if mesh is None:
    mc = MeshConfig()
    mesh, rules = make_mesh(mc), (mc.rules if rules is None else rules)
  return mesh, rules or ()


def logical_shardings(logical_tree, mesh: Mesh, rules):
  """A tree of logical PartitionSpecs -> the same tree of NamedShardings."""
  return nn.logical_to_mesh_sharding(logical_tree, mesh, list(rules))


def logical_sharding(mesh: Mesh, rules, *axes) -> NamedSharding:
  """NamedSharding for one array with logical axes, e.g. ('batch', None)."""
  return nn.logical_to_mesh_sharding(P(*axes), mesh, list(rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_size_multiple(mesh: Mesh, rules) -> int:
  """How many rows a batch must be a multiple of to split over the batch axes."""
  spec = logical_sharding(mesh, rules, "batch").spec[0]
  axes = (spec,) if isinstance(spec, str) else (spec or ())
  return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


# -- activations ------------------------------------------------------------------
# Activations carry logical names too (MaxText's convention): 'activation_batch',
# 'activation_length', 'activation_embed', 'activation_heads', 'activation_mlp',
# 'activation_vocab'. `constrain` pins one to its layout's sharding while a train step
# traces under `activation_sharding(mesh, rules)` (train/step.py); anywhere else (the
# sampler, tests calling a model directly) it is the identity.
_ACTIVATIONS = threading.local()  # (mesh, rules) while a train step traces


@contextlib.contextmanager
def activation_sharding(mesh, rules):
  """Within: `constrain` maps activations' logical axes to `mesh` by `rules`."""
  before = getattr(_ACTIVATIONS, "value", None)
  _ACTIVATIONS.value = (mesh, list(rules))
  try:
    yield
  finally:
    _ACTIVATIONS.value = before


def constrain(x, *axes):
  """x with the sharding its logical axes (one per dimension) get from the active
  layout's rules; the identity outside `activation_sharding`."""
  active = getattr(_ACTIVATIONS, "value", None)
  if active is None:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, nn.logical_to_mesh_axes(axes, rules)))
