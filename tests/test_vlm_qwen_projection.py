"""scripts/project_vlm_speedup.py's FLOP counts against the parameter counts of the
real architecture, built independently (our QwenVisionTower and DecoderLM from
configs/models/qwen2_5_7b.gin, shapes only): the projection's matmul FLOPs must be
2 x the parameters each token passes through."""
import os
import sys

import gin
import numpy as np
from flax import nnx

from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.models.qwen_vision import QwenVisionConfig, QwenVisionTower

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import project_vlm_speedup as proj  # noqa: E402


def counts(model, top):
  """Parameters under each top-level name."""
  out = {}
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    key = str(path[0])
    out[key] = out.get(key, 0) + int(np.prod(v.shape))
  return out if top is None else out[top]


def test_projection_flops_match_the_architectures_parameters():
  v = proj.VISION
  config = QwenVisionConfig(family="qwen2_vl", depth=v["depth"], width=v["width"],
                            heads=v["heads"], mlp_width=v["mlp_width"], out_width=proj.LM["width"],
                            patch_size=v["patch"], temporal_patch_size=v["temporal"],
                            merge=v["merge"], act="quick_gelu", norm="layernorm", mlp="fc",
                            window_size=0, full_attention_layers=())
  with nnx.use_eager_sharding(False):
    tower = nnx.eval_shape(lambda: QwenVisionTower(config, nnx.Rngs(0)))
  c = counts(tower, None)
  image = 448
  n = (image // v["patch"]) ** 2
  attention = v["depth"] * 4 * n * n * v["width"]  # scores and weighted sums, per layer
  want = 2 * n * (c["patch"] + c["blocks"]) + 2 * (n // 4) * c["merger"] + attention
  # Norms and biases are counted as parameters here, not in the projection's matmuls.
  assert abs(proj.tower_flops(image) - want) / want < 2e-3, (proj.tower_flops(image), want)

  gin.clear_config()
  gin.parse_config_file("configs/models/qwen2_5_7b.gin")
  lm_cfg = DecoderConfig()
  gin.clear_config()
  assert (lm_cfg.width, lm_cfg.depth, lm_cfg.mlp_width, lm_cfg.vocab_size) == (
      proj.LM["width"], proj.LM["depth"], proj.LM["mlp_width"], proj.LM["vocab"])
  with nnx.use_eager_sharding(False):
    lm = nnx.eval_shape(lambda: DecoderLM(lm_cfg, nnx.Rngs(0)))
  c = counts(lm, None)
  per_token = 2 * (sum(c.values()) - c["embed"])  # every matmul weight, the head included
  assert abs(proj.lm_flops(1) - per_token) / per_token < 2e-3, (proj.lm_flops(1), per_token)
