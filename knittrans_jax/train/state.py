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

from knittrans_jax.train.mesh import logical_shardings, replicated


class TrainState(NamedTuple):
  params: nnx.State
  opt_state: Any
  version: jax.Array  # int32 scalar: optimizer steps applied = policy version
  rng: jax.Array  # uint32 key data


def _build(model_fn: Callable[[nnx.Rngs], nnx.Module], seed: int):
  with nnx.use_eager_sharding(False):  # shardings come from the mesh rules below
    return model_fn(nnx.Rngs(seed))


def init_train_state(model_fn: Callable[[nnx.Rngs], nnx.Module], tx: optax.GradientTransformation,
                     mesh: Mesh, rules, seed: int = 0):
  """Returns (graphdef, state, state_shardings)."""
  abstract = nnx.eval_shape(lambda: _build(model_fn, seed))
  graphdef, abs_params = nnx.split(abstract, nnx.Param)
  param_sh = logical_shardings(nnx.get_partition_spec(abs_params), mesh, rules)
  abs_opt = jax.eval_shape(tx.init, abs_params)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abs_opt, param_sh,
                                 transform_non_params=lambda _: replicated(mesh))
  repl = replicated(mesh)
  shardings = TrainState(param_sh, opt_sh, repl, repl)

  def init():
    params = nnx.state(_build(model_fn, seed), nnx.Param)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32),
                      jax.random.key_data(jax.random.key(seed)))

  state = jax.jit(init, out_shardings=shardings)()
  return graphdef, state, shardings


def abstract_state(state: TrainState, shardings: TrainState) -> TrainState:
  """ShapeDtypeStructs with shardings: the restore target for checkpoints."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)
