"""The Qwen2-VL / Qwen2.5-VL vision tower and image processor against transformers,
on tiny random checkpoints (patch 4, merge 2, width 32, 4 heads)."""
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from PIL import Image

from hf_helpers import randomize_vl_
from knittrans_jax.mesh import MeshConfig, make_mesh
from knittrans_jax.models import qwen_image_processor as qip
from knittrans_jax.models import qwen_vision as qv
from knittrans_jax.models import qwen_vision_hf as qv_hf
from knittrans_jax.models.hf import CheckpointError

FSDP_TP = MeshConfig(axes=(("fsdp", -1), ("tensor", 2)),
                     rules=(("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor")))
TEXT = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                             "rope_theta": 10000.0})
VISION = {
    "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration,
                 dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, mlp_ratio=2,
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2)),
    # A window of 16 pixels is 2 x 2 merged tokens: the 6 x 10 patch image below has
    # 2 x 3 windows, some partial. Layer 1 of 3 attends over the whole image.
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                   dict(depth=3, hidden_size=32, intermediate_size=40, out_hidden_size=48,
                        num_heads=4, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                        window_size=16, fullatt_block_indexes=[1])),
}
GRIDS = {"one image": [[1, 6, 10]],
         "two images": [[1, 6, 10], [1, 8, 4]],
         "a two-frame clip and an image": [[2, 4, 6], [1, 10, 10]]}


def rel_err(ours, theirs):
  return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """family -> (directory, transformers' vision module), each made once."""
  out = {}
  for family, (cfg_cls, model_cls, vision) in VISION.items():
    torch.manual_seed(0)
    model = model_cls(cfg_cls(text_config=TEXT, vision_config=vision)).eval()
    randomize_vl_(model.model.visual.named_parameters())
    path = str(tmp_path_factory.mktemp(family))
    model.save_pretrained(path)
    out[family] = (path, model.model.visual)
  return out


@pytest.fixture(scope="module")
def towers(checkpoints):
  """family -> (our tower on an fsdp x tensor mesh of the 8 CPU devices, its config)."""
  mesh = make_mesh(FSDP_TP)
  return {f: qv_hf.load(path, mesh=mesh, rules=FSDP_TP.rules) for f, (path, _) in checkpoints.items()}


def pixels(grid, patch_dim, seed=0):
  n = int(np.prod(np.asarray(grid), axis=1).sum())
  return np.random.default_rng(seed).standard_normal((n, patch_dim)).astype(np.float32)


def ours(tower, pv, grid):
  grid = tuple(map(tuple, grid))
  return np.asarray(nnx.jit(lambda t, x: t(x, grid))(tower, pv))


def theirs(visual, pv, grid):
  with torch.no_grad():
    out = visual(torch.from_numpy(pv), grid_thw=torch.tensor(grid))
  return out.pooler_output.numpy()


@pytest.mark.parametrize("case", sorted(GRIDS))
@pytest.mark.parametrize("family", sorted(VISION))
def test_tower_matches_transformers(checkpoints, towers, family, case):
  tower, config = towers[family]
  assert config.family == family
  grid = GRIDS[case]
  pv = pixels(grid, config.patch_dim)
  a, b = ours(tower, pv, grid), theirs(checkpoints[family][1], pv, grid)
  assert a.shape == b.shape == (len(pv) // 4, 48)
  err = rel_err(a, b)
  print(f"{family} / {case}: max relative error {err:.2e}")
  assert err <= 1e-4, f"{family} / {case}: max relative error {err:.2e}"


def test_parameters_are_sharded_by_logical_axes(towers):
  tower, _ = towers["qwen2_5_vl"]
  q = nnx.state(tower, nnx.Param)["blocks"][0]["attn"]["q"]["kernel"].get_value()
  assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated


def test_windows_are_transformers_windows_and_matter(checkpoints, towers):
  from transformers.vision_utils import get_vision_window_index
  tower, config = towers["qwen2_5_vl"]
  grid = GRIDS["two images"]
  layout = qv.patch_layout(config, grid)
  index, cu = get_vision_window_index(torch.tensor(grid), config.merge, config.window_size,
                                      config.patch_size)
  np.testing.assert_array_equal(layout.order, index.numpy())
  np.testing.assert_array_equal(np.r_[0, np.cumsum(np.bincount(layout.windows))], cu.numpy())
  assert len(cu) - 1 == 6 + 2  # 2 x 3 windows and 2 x 1: windowing is exercised
  # The same weights with every layer attending over the whole image differ clearly.
  graphdef, state = nnx.split(tower)
  unwindowed = nnx.merge(graphdef, state)
  unwindowed.config = dataclasses.replace(config, window_size=0)
  pv = pixels(grid, config.patch_dim)
  assert rel_err(ours(unwindowed, pv, grid), theirs(checkpoints["qwen2_5_vl"][1], pv, grid)) > 1e-2


def test_model_visual_prefix_loads_the_same(checkpoints, towers, tmp_path):
  from safetensors.numpy import load_file, save_file
  src, _ = checkpoints["qwen2_vl"]
  path = str(tmp_path / "renamed")
  os.makedirs(path)
  tensors = load_file(os.path.join(src, "model.safetensors"))
  save_file({("model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()},
            os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(src, "config.json")) as f, \
      open(os.path.join(path, "config.json"), "w") as g:
    g.write(f.read())
  tower, _ = qv_hf.load(path)
  a = jax.tree.leaves(nnx.state(tower, nnx.Param))
  b = jax.tree.leaves(nnx.state(towers["qwen2_vl"][0], nnx.Param))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_released_style_configs_read_as_transformers_reads_them():
  """The released config.json spellings: `in_chans`, no hidden_act (Qwen2-VL), the
  vision model_type 'qwen2_5_vl'; our fields against transformers' config objects."""
  q2 = {"model_type": "qwen2_vl", "vision_config": {
      "depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
      "temporal_patch_size": 2}}
  q25 = {"model_type": "qwen2_5_vl", "vision_config": {
      "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
      "temporal_patch_size": 2, "model_type": "qwen2_5_vl"}}
  a = qv_hf.config_from_hf(q2)
  v = transformers.Qwen2VLConfig(vision_config=q2["vision_config"]).vision_config
  assert (a.width, a.out_width, a.mlp_width, a.act, a.heads, a.depth) == (
      v.embed_dim, v.hidden_size, int(v.embed_dim * v.mlp_ratio), v.hidden_act, v.num_heads,
      v.depth)
  assert (a.norm, a.mlp, a.window_size) == ("layernorm", "fc", 0)
  b = qv_hf.config_from_hf(q25, dtype="bfloat16")
  v = transformers.Qwen2_5_VLConfig(vision_config=q25["vision_config"]).vision_config
  assert (b.width, b.out_width, b.mlp_width, b.act, b.window_size, b.full_attention_layers) == (
      v.hidden_size, v.out_hidden_size, v.intermediate_size, v.hidden_act, v.window_size,
      tuple(v.fullatt_block_indexes))
  assert (b.norm, b.mlp, b.dtype, b.window_units) == ("rmsnorm", "gated", "bfloat16", 4)


def test_bad_inputs_name_the_field_and_shapes(towers):
  tower, config = towers["qwen2_vl"]
  grid = [[1, 6, 10]]
  with pytest.raises(ValueError, match=r"pixel_values has shape \(60, 95\); image_grid_thw "
                                       r"\[\[1, 6, 10\]\] needs \(60, 96\)"):
    tower(pixels(grid, 95), grid)
  with pytest.raises(ValueError, match=r"pixel_values has shape \(59, 96\).*needs \(60, 96\)"):
    tower(pixels(grid, 96)[:59], grid)
  with pytest.raises(ValueError, match=r"image_grid_thw\[0\] = \(1, 5, 10\).*multiples of merge"):
    tower(pixels([[1, 5, 10]], 96), [[1, 5, 10]])
  with pytest.raises(ValueError, match=r"image_grid_thw has shape \(3,\)"):
    tower(pixels(grid, 96), [1, 6, 10])
  with pytest.raises(ValueError, match="static argument"):
    jax.jit(lambda g: tower(pixels(grid, 96), g))(np.asarray(grid))


@pytest.mark.parametrize("case,match", [
    ("shape", r"tensor visual.blocks.1.attn.qkv.weight has shape \(90, 32\), "
              r"the config needs \(96, 32\)"),
    ("missing", r"missing tensor\(s\) \['visual.merger.ln_q.bias'\]"),
    ("extra", r"unexpected tensor\(s\) \['visual.blocks.2.norm1.weight'\]"),
    ("no_visual", r"no vision tensors"),
    ("model_type", r"model_type='llava'.*not one of"),
])
def test_bad_checkpoints_name_the_tensor(checkpoints, tmp_path, case, match):
  from safetensors.numpy import load_file, save_file
  src, _ = checkpoints["qwen2_vl"]
  tensors = load_file(os.path.join(src, "model.safetensors"))
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  if case == "shape":
    tensors["visual.blocks.1.attn.qkv.weight"] = np.zeros((90, 32), np.float32)
  elif case == "missing":
    del tensors["visual.merger.ln_q.bias"]
  elif case == "extra":
    tensors["visual.blocks.2.norm1.weight"] = np.ones(32, np.float32)
  elif case == "no_visual":
    tensors = {k: v for k, v in tensors.items() if "visual" not in k}
  elif case == "model_type":
    config["model_type"] = "llava"
    config["vision_config"]["model_type"] = "clip_vision_model"
  path = str(tmp_path / case)
  os.makedirs(path)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(CheckpointError, match=match):
    qv_hf.load(path)


def _drops_alpha() -> bool:
  return tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 20)


def test_image_processor_matches_transformers():
  """Two RGB images of different sizes (one over max_pixels, one under min_pixels)
  and an RGBA one: the same pixel_values and image_grid_thw as transformers'
  Qwen2VLImageProcessorPil (PIL bicubic resize, as ours)."""
  rng = np.random.default_rng(0)
  images = [rng.integers(0, 256, (37, 61, 3), dtype=np.uint8),
            rng.integers(0, 256, (90, 50, 3), dtype=np.uint8),
            rng.integers(0, 256, (12, 10, 3), dtype=np.uint8),
            Image.fromarray(rng.integers(0, 256, (40, 40, 4), dtype=np.uint8), "RGBA")]
  kw = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=24 * 24,
            max_pixels=48 * 48)
  theirs = images
  if _drops_alpha():  # transformers < 5.20 (vLLM's pin) drops alpha; 5.20+ composites as we do
    theirs = images[:3] + [Image.alpha_composite(Image.new("RGBA", images[3].size, (255,) * 4),
                                                 images[3]).convert("RGB")]
  want = transformers.Qwen2VLImageProcessorPil(**kw)(images=theirs, return_tensors="np")
  pv, grid = qip.preprocess(images, qip.QwenImageProcessorConfig(**kw))
  np.testing.assert_array_equal(grid, want["image_grid_thw"])
  assert pv.dtype == np.float32 and pv.shape == want["pixel_values"].shape
  np.testing.assert_allclose(pv, want["pixel_values"], rtol=0, atol=1e-5)
  assert grid.tolist()[1] == [1, 16, 8] and grid.tolist()[2] == [1, 8, 6]  # resized both ways
  # The defaults (patch 14) and the released preprocessor_config.json keys.
  default = transformers.Qwen2VLImageProcessorPil()(images=images[:2], return_tensors="np")
  pv, grid = qip.preprocess(images[:2], qip.config_from_hf(
      {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2,
       "temporal_patch_size": 2, "image_mean": list(qip.OPENAI_CLIP_MEAN),
       "image_std": list(qip.OPENAI_CLIP_STD)}))
  np.testing.assert_array_equal(grid, default["image_grid_thw"])
  np.testing.assert_allclose(pv, default["pixel_values"], rtol=0, atol=1e-5)
  with pytest.raises(ValueError, match=r"image array of shape \(8, 8, 3\) and dtype float32"):
    qip.preprocess([np.zeros((8, 8, 3), np.float32)])
