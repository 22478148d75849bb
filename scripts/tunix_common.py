"""What both Tunix workloads of scripts/tunix_side.py build (in Tunix's venv): text as
decimal ids and its tokenizer, the workload's model (initialised as ours, patch 5 of
tunix_side.py), its optimizer and the 1x1 mesh. Imported by path from scripts/; from the
project only the pure task module (tunix_side.py puts the checkout on sys.path)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen2 import model as qwen2_lib

from knittrans_jax.rollout import tasks


def ids_to_text(ids) -> str:
  return " ".join(str(int(i)) for i in ids)


def text_to_ids(text: str) -> np.ndarray:
  return np.array([int(t) for t in text.split()], np.int32)


class IdTokenizer:
  """Text is the ids as decimal ints; maps ids 1:1 and adds nothing (Tunix prepends
  BOS and drops a doubled one: our prompts start with BOS, so they come out as is)."""

  def encode(self, text: str, **kwargs) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs) -> str:
    return ids_to_text(ids)

  def bos_id(self) -> int:
    return tasks.BOS

  def eos_id(self) -> int:
    return tasks.EOS

  def pad_id(self) -> int:
    return tasks.PAD


def make_model(W: dict, patches: list[str], mesh):
  """W's decoder as Tunix's Qwen2, initialised as ours; (model, parameter count)."""
  m = W["model"]
  seed = W["seed"]
  cfg = qwen2_lib.ModelConfig(
      num_layers=m["depth"], vocab_size=m["vocab_size"], embed_dim=m["width"],
      hidden_dim=m["mlp_width"], num_heads=m["heads"], head_dim=m["head_dim"],
      num_kv_heads=m["kv_heads"], rope_theta=int(m["rope_theta"]), norm_eps=m["norm_eps"],
      use_tied_embedding=m["tie_embeddings"])
  with mesh:
    model = qwen2_lib.Qwen2(cfg, rngs=nnx.Rngs(seed))
  # Patch 5: ours' initialisation (module doc).
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  key = jax.random.PRNGKey(seed)
  new = []
  for i, (path, x) in enumerate(leaves):
    name = jax.tree_util.keystr(path)
    if "bias" in name:
      v = jnp.zeros_like(x)
    elif "norm" in name:
      v = jnp.ones_like(x)
    else:
      v = 0.02 * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
    new.append(jax.device_put(v, x.sharding))
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))
  patches.append("model initialised as ours: N(0, 0.02) matrices, zero biases, unit norms")
  return model, sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def make_optimizer(W: dict, updates: int):
  o = W["optimizer"]
  if o["schedule"] != "cosine":
    raise ValueError(f"optimizer schedule {o['schedule']!r}: this side builds 'cosine' only")
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, o["learning_rate"], o["warmup_steps"], max(updates, o["warmup_steps"] + 1),
      end_value=0.1 * o["learning_rate"])
  parts = [optax.clip_by_global_norm(o["clip_norm"])] if o["clip_norm"] else []
  parts.append(optax.adamw(schedule, b1=o["b1"], b2=o["b2"], eps=o["eps"],
                           weight_decay=o["weight_decay"]))
  return optax.chain(*parts)


def mesh_1x1():
  # Auto axes, as tunix/utils/mesh.py makes them (Explicit axes break the embedding gather).
  return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
