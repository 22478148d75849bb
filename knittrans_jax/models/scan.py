"""Scanned layers: `depth` identical blocks held as one module whose parameters carry a
leading 'layers' axis, run by one jax.lax.scan, so compile time and program size stop
growing with depth (MaxText's scanned layers). The 'layers' axis is never sharded (no
layout maps it: every device holds its slice of every layer).

Checkpoint IO sees layers one at a time either way: `layer_entries` lists a stacked
parameter [L, ...] as L per-layer entries at the paths an unscanned model has
(('blocks', i, ...)), which is what the Hugging Face names are made from.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import jax
from flax import nnx

LAYERS = "layers"  # the logical name of the stacked axis


def stack(make: Callable[[nnx.Rngs], nnx.Module], depth: int, rngs: nnx.Rngs) -> nnx.Module:
  """One module like make(rngs), each parameter stacked over `depth` layers (each layer
  initialised from its own split of `rngs`)."""

  @nnx.split_rngs(splits=depth)
  @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=depth,
            transform_metadata={nnx.PARTITION_NAME: LAYERS})
  def build(r):
    return make(r)

  return build(rngs)


def scan(stacked: nnx.Module, body: Callable, carry, xs: Any = None, *, policy=None,
         remat: bool = False):
  """jax.lax.scan of body(layer, carry, x) -> (carry, y) over the layers of `stacked`
  (and the leading axis of `xs`). `remat` wraps each layer in jax.checkpoint with
  `policy` (what the backward pass may keep). Returns (carry, stacked ys)."""
  graphdef, state = nnx.split(stacked)

  def step(c, inp):
    layer_state, x = inp
    return body(nnx.merge(graphdef, layer_state), c, x)

  if remat:
    step = jax.checkpoint(step, policy=policy, prevent_cse=False)  # CSE cannot undo remat in a scan
  return jax.lax.scan(step, carry, (state, xs))


def is_stacked(path: tuple) -> bool:
  """Whether a flat parameter path of a model is a scanned stack's (('blocks', 'attn',
  ...)) rather than one layer's (('blocks', 3, 'attn', ...))."""
  return len(path) > 1 and _key(path[0]) == "blocks" and not isinstance(_key(path[1]), int)


def layer_entries(params) -> Iterator[tuple[tuple, tuple[int, ...], Callable[[], Any]]]:
  """(path, shape, get) for every parameter of `params` (an nnx.State), a stacked one as
  one entry per layer at ('blocks', i, ...): `get()` returns that layer's array (sliced
  only when called)."""
  for path, v in nnx.to_flat_state(params):
    a = v.get_value() if hasattr(v, "get_value") else v
    path = tuple(_key(p) for p in path)
    if not is_stacked(path):
      yield path, tuple(a.shape), (lambda a=a: a)
      continue
    for i in range(a.shape[0]):
      yield ("blocks", i) + path[1:], tuple(a.shape[1:]), (lambda a=a, i=i: a[i])


def _key(p):
  return p.key if hasattr(p, "key") else getattr(p, "idx", p)
