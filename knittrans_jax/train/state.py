"""The train state and its sharded initialisation.

The model lives as (graphdef, params): `nnx.split` once here, `nnx.merge` inside
each jitted step. Parameters and optimizer state are created directly with their
NamedShardings (jit with out_shardings), never materialised on one device first.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from knittrans_jax.mesh import logical_shardings, replicated


class TrainState(NamedTuple):
  params: nnx.State
  opt_state: Any
  version: jax.Array  # int32 scalar: optimizer steps applied = policy version


def _build(model_fn: Callable[[nnx.Rngs], nnx.Module], seed: int):
  with nnx.use_eager_sharding(False):  # shardings come from the mesh rules below
    return model_fn(nnx.Rngs(seed))


def train_state_shapes(model_fn: Callable[[nnx.Rngs], nnx.Module],
                       tx: optax.GradientTransformation, mesh: Mesh, rules):
  """(graphdef, abstract TrainState of ShapeDtypeStructs with shardings, shardings),
  computed without creating any array: the restore target for a checkpoint."""
  abstract = nnx.eval_shape(lambda: _build(model_fn, 0))
  graphdef, abs_params = nnx.split(abstract, nnx.Param)
  param_sh = logical_shardings(nnx.get_partition_spec(abs_params), mesh, rules)
  abs_opt = jax.eval_shape(tx.init, abs_params)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abs_opt, param_sh,
                                 transform_non_params=lambda _: replicated(mesh))
  repl = replicated(mesh)
  shardings = TrainState(param_sh, opt_sh, repl)

  def init():
    params = nnx.state(_build(model_fn, 0), nnx.Param)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
  return graphdef, abstract_state(jax.eval_shape(init), shardings), shardings


def init_train_state(model_fn: Callable[[nnx.Rngs], nnx.Module], tx: optax.GradientTransformation,
                     mesh: Mesh, rules, seed: int = 0, params: nnx.State | None = None):
  """Returns (graphdef, state, state_shardings). `params` (e.g. a loaded checkpoint,
  already placed on the mesh) replace the random initial parameters."""
  graphdef, abstract, shardings = train_state_shapes(model_fn, tx, mesh, rules)
  abs_params, param_sh = abstract.params, shardings.params

  def init(params):
    if params is None:
      params = nnx.state(_build(model_fn, seed), nnx.Param)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))

  if params is not None:
    got, want = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (params, abs_params))
    for (path, a), (_, b) in zip(got, want):
      if (a.shape, a.dtype) != (b.shape, b.dtype):
        raise ValueError(f"init_train_state: parameter {jax.tree_util.keystr(path)} is "
                         f"{a.shape} {a.dtype}, the model needs {b.shape} {b.dtype}")
    if len(got) != len(want):
      raise ValueError(f"init_train_state: {len(got)} parameters given, the model has {len(want)}")
    state = jax.jit(init, in_shardings=(param_sh,), out_shardings=shardings)(params)
  else:
    state = jax.jit(init, out_shardings=shardings, static_argnums=0)(None)
  return graphdef, state, shardings


def abstract_state(state: TrainState, shardings: TrainState) -> TrainState:
  """ShapeDtypeStructs with shardings: the restore target for checkpoints."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)
