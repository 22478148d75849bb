"""Weight sync (rollout/weights.py): shards written per process, assembled on the
worker's host; stale versions of a longer run removed on resume; pruning."""
import os

import gin
import jax
import numpy as np
import pytest
from flax import nnx

from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rollout.weights import WeightPublisher, WeightSubscriber
from knittrans_jax.train import MeshConfig, OptimizerConfig, init_train_state, make_mesh, make_optimizer

CFG = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64)


def fsdp_params():
  gin.clear_config()
  gin.parse_config_file("configs/mesh/fsdp.gin")
  mesh_cfg = MeshConfig()
  gin.clear_config()
  _, state, _ = init_train_state(lambda r: DecoderLM(CFG, r), make_optimizer(OptimizerConfig()),
                                 make_mesh(mesh_cfg), mesh_cfg.rules, 0)
  return state.params


def template():
  with nnx.use_eager_sharding(False):
    return nnx.split(DecoderLM(CFG, nnx.Rngs(1)), nnx.Param)[1]


def test_sharded_parts_assemble_to_the_full_parameters(tmp_path):
  params = fsdp_params()
  split = [x for x in jax.tree.leaves(params) if not x.is_fully_replicated]
  assert split, "the fsdp layout splits some parameters, so shards are really assembled"
  pub = WeightPublisher(str(tmp_path))
  pub.write_part(3, params)
  with pytest.raises(RuntimeError, match=r"parts \[1\] of 2 are missing"):
    pub.commit(3, parts=2)
  pub.commit(3, parts=1)
  sub = WeightSubscriber(str(tmp_path), template())
  version, got = sub.poll()
  assert version == 3 and sub.poll() is None
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_resume_removes_versions_of_the_longer_run_and_pruning_keeps_the_newest(tmp_path):
  params = template()
  first = WeightPublisher(str(tmp_path), keep=2)
  for v in range(6):
    first.write_part(v, params)
    first.commit(v)
  assert sorted(os.listdir(tmp_path / "weights")) == ["LATEST", "v00000004", "v00000005"]
  # Resumed from the checkpoint at version 3: 4 and 5 belong to the run that went on.
  again = WeightPublisher(str(tmp_path), keep=2, version=3)
  assert sorted(os.listdir(tmp_path / "weights")) == ["LATEST"]
  for v in (3, 4):
    again.write_part(v, params)
    again.commit(v)
  assert sorted(os.listdir(tmp_path / "weights")) == ["LATEST", "v00000003", "v00000004"]
  assert WeightSubscriber(str(tmp_path), params).poll()[0] == 4
