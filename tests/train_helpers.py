"""Builds the tiny model's train state and step functions on a mesh layout."""
import gin
import numpy as np

from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rl import LossConfig
from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, init_train_state,
                                 make_mesh, make_optimizer)

CFG = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64)


def build(layout: str, objective: str = "ppo", lr: float = 1e-3, seed: int = 0,
          loss: LossConfig | None = None):
  gin.clear_config()
  gin.parse_config_file(f"configs/mesh/{layout}.gin")
  mesh_cfg = MeshConfig()
  gin.clear_config()
  mesh = make_mesh(mesh_cfg)
  tx = make_optimizer(OptimizerConfig(learning_rate=lr))
  graphdef, state, shardings = init_train_state(lambda r: DecoderLM(CFG, r), tx, mesh,
                                                mesh_cfg.rules, seed)
  fns = StepFunctions(graphdef, shardings, tx, loss or LossConfig(), mesh, mesh_cfg.rules,
                      objective=objective)
  return fns, state


def random_batch(rng, B=16, T=24, vocab=64):
  lengths = rng.integers(T // 2, T + 1, B)
  attn = np.arange(T)[None] < lengths[:, None]
  prompt = 4
  loss_mask = attn & (np.arange(T)[None] >= prompt)
  return dict(tokens=np.where(attn, rng.integers(0, vocab, (B, T)), 0).astype(np.int32),
              attention_mask=attn, loss_mask=loss_mask.astype(np.float32),
              behaviour_logp=np.where(loss_mask, -rng.uniform(3.5, 4.5, (B, T)), 0).astype(np.float32),
              advantages=rng.normal(size=B).astype(np.float32))


def micro_grads(fns, state, batches, total, acc=None):
  """The job's path: `micro_step` over `batches` (one dict or a list) into `acc`
  (fresh fp32 zeros by default); returns (gradients, metric sums)."""
  batches = [batches] if isinstance(batches, dict) else list(batches)
  acc = fns.zero_grads(state.params) if acc is None else acc
  sums = fns.zero_sums(state, batches[0])
  for b in batches:
    acc, sums = fns.micro_step(state, acc, sums, b, total)
  return acc, sums


def to_numpy(tree):
  import jax
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
