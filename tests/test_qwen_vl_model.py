"""Whole Qwen2-VL / Qwen2.5-VL models against transformers: M-RoPE positions, logits
with images among the text, greedy decoding through prefill/decode_step, loading."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from hf_helpers import END, IMAGE, QWEN_VL, START, make_qwen_vl_checkpoint
from knittrans_jax.mesh import MeshConfig, make_mesh
from knittrans_jax.models import qwen_vl
from knittrans_jax.models.hf import CheckpointError

FSDP_TP = MeshConfig(axes=(("fsdp", -1), ("tensor", 2)),
                     rules=(("batch", "fsdp"), ("embed", "fsdp"), ("heads", "tensor"),
                            ("mlp", "tensor"), ("vocab", "tensor")))
# The tiny checkpoints (hf_helpers.QWEN_VL): head dim 16, M-RoPE sections 2 / 3 / 3;
# qwen2_vl tied, qwen2_5_vl untied with 2 x 2-token windows.
FAMILIES = QWEN_VL
# Row 0: one tall image (5 x 3 merged); row 1: a wide image, text, then a smaller one;
# row 2: text only. Left-padded to one length.
GRID = [[1, 10, 6], [1, 6, 10], [1, 8, 4]]
CASES = ("one image", "two images", "text only")
N_NEW = 6


def rel_err(ours, theirs):
  return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def image(n):
  return [START] + [IMAGE] * n + [END]


def prompts():
  rng = np.random.default_rng(0)

  def text(n):
    return rng.integers(2, IMAGE, n).tolist()
  rows = [text(3) + image(15) + text(5),
          text(2) + image(15) + text(4) + image(8) + text(3),
          text(7)]
  T = max(map(len, rows))
  ids = np.zeros((len(rows), T), np.int64)
  mask = np.zeros((len(rows), T), np.int64)
  for i, r in enumerate(rows):
    ids[i, T - len(r):], mask[i, T - len(r):] = r, 1
  pixel_values = rng.standard_normal((int(np.prod(GRID, axis=1).sum()), 96)).astype(np.float32)
  return ids, mask, pixel_values, np.asarray(GRID)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
  """family -> (directory, transformers' model, our model), each made once."""
  out = {}
  mesh = make_mesh(FSDP_TP)
  for family, (*_, tied) in FAMILIES.items():
    path = str(tmp_path_factory.mktemp(family))
    theirs = make_qwen_vl_checkpoint(family, path)
    model, config = qwen_vl.load(path, mesh=mesh, rules=FSDP_TP.rules)
    assert config.family == family and config.text.tie_embeddings == tied
    out[family] = (path, theirs, model)
  return out


def their_inputs(ids, mask, pixel_values, grid):
  return dict(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
              pixel_values=torch.from_numpy(pixel_values), image_grid_thw=torch.from_numpy(grid),
              mm_token_type_ids=torch.from_numpy((ids == IMAGE).astype(np.int64)))


def test_mrope_positions_are_get_rope_index(families):
  _, theirs, model = families["qwen2_vl"]
  ids, mask, _, grid = prompts()
  pos, delta = qwen_vl.mrope_positions(ids, grid, model.config, mask)
  want, want_delta = theirs.model.get_rope_index(
      torch.from_numpy(ids), torch.from_numpy((ids == IMAGE).astype(np.int64)),
      image_grid_thw=torch.from_numpy(grid), attention_mask=torch.from_numpy(mask))
  np.testing.assert_array_equal(pos, want.numpy())
  np.testing.assert_array_equal(delta, want_delta.numpy()[:, 0])
  # The tall image's rows run further than its columns, the wide one's the other way.
  assert delta.tolist() == [5 - 15, (5 - 15) + (4 - 8), 0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(families, family):
  _, theirs, model = families[family]
  ids, mask, pv, grid = prompts()
  pos, _ = qwen_vl.mrope_positions(ids, grid, model.config, mask)
  static = tuple(map(tuple, grid.tolist()))
  forward = nnx.jit(lambda m, t, a, x, p: m(t, a, x, static, positions=p))
  ours = np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask), pv, pos))
  with torch.no_grad():
    want = theirs(**their_inputs(ids, mask, pv, grid)).logits.numpy()
  valid = mask.astype(bool)
  errs = {case: rel_err(ours[i][valid[i]], want[i][valid[i]]) for i, case in enumerate(CASES)}
  print(f"{family}: max relative logit error " +
        ", ".join(f"{c} {e:.2e}" for c, e in errs.items()))
  assert max(errs.values()) <= 1e-4, (family, errs)
  # 1-D positions (every section at the text position) miss clearly: M-RoPE matters.
  flat = np.broadcast_to(np.maximum(np.cumsum(mask, 1) - 1, 0), pos.shape).astype(np.int32)
  wrong = np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask), pv, flat))
  miss = rel_err(wrong[0][valid[0]], want[0][valid[0]])
  print(f"{family}: with 1-D positions {miss:.2e}")
  assert miss > 1e-2



@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scanned_layers_match_and_export_the_same_tensors(families, family, tmp_path):
  """scan_layers (decoder and vision tower, Qwen2.5-VL's full-attention layer a branch
  of the scan): transformers' logits, and a save that transformers loads tensor for
  tensor equal to the checkpoint."""
  path, theirs, _ = families[family]
  model, config = qwen_vl.load(path, mesh=make_mesh(FSDP_TP), rules=FSDP_TP.rules,
                               scan_layers=True)
  assert config.text.scan_layers and config.vision.scan_layers
  ids, mask, pv, grid = prompts()
  pos, _ = qwen_vl.mrope_positions(ids, grid, model.config, mask)
  static = tuple(map(tuple, grid.tolist()))
  ours = np.asarray(nnx.jit(lambda m, t, a, x, p: m(t, a, x, static, positions=p))(
      model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask), pv, pos))
  with torch.no_grad():
    want = theirs(**their_inputs(ids, mask, pv, grid)).logits.numpy()
  valid = mask.astype(bool)
  assert rel_err(ours[valid], want[valid]) <= 1e-4
  out = str(tmp_path / "export")
  qwen_vl.save(model, out, like=path)
  back = FAMILIES[family][1].from_pretrained(out).state_dict()
  for name, w in theirs.state_dict().items():
    torch.testing.assert_close(back[name], w, rtol=0, atol=0, msg=name)

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_decoding_matches_transformers_generate(families, family):
  """prefill + decode_step as the sampler drives them: left-padded prompts, cache
  slots P + t, text positions (real tokens so far) + the cache's rope delta. The
  same tokens as transformers' greedy generate, and the same logits at every step."""
  _, theirs, model = families[family]
  ids, mask, pv, grid = prompts()
  B, P = ids.shape
  pos, delta = qwen_vl.mrope_positions(ids, grid, model.config, mask)
  static = tuple(map(tuple, grid.tolist()))
  valid = jnp.asarray(mask.astype(bool))
  prefill = nnx.jit(lambda m, t, v, x, p, d: m.prefill(t, v, P + N_NEW, x, static, positions=p,
                                                       rope_delta=d))
  step = nnx.jit(lambda m, *a: m.decode_step(*a))

  def greedy(rope_delta):
    logits, cache = prefill(model, jnp.asarray(ids, jnp.int32), valid, pv, pos, rope_delta)
    key_valid = jnp.concatenate([valid, jnp.zeros((B, N_NEW), bool)], axis=1)
    start = valid.sum(axis=1).astype(jnp.int32)
    tokens, all_logits = [], [np.asarray(logits)]
    for t in range(N_NEW):
      token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      tokens.append(np.asarray(token))
      key_valid = key_valid.at[:, P + t].set(True)
      logits, cache = step(model, token, start + t, cache, P + t, key_valid)
      all_logits.append(np.asarray(logits))
    return np.stack(tokens, axis=1), np.stack(all_logits[:-1], axis=1)

  tokens, logits = greedy(delta)
  with torch.no_grad():
    out = theirs.generate(**their_inputs(ids, mask, pv, grid), max_new_tokens=N_NEW,
                          min_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, return_dict_in_generate=True, output_logits=True)
  want = torch.stack(out.logits, dim=1).numpy()
  np.testing.assert_array_equal(tokens, out.sequences.numpy()[:, P:], err_msg=family)
  errs = [rel_err(logits[:, t], want[:, t]) for t in range(N_NEW)]
  print(f"{family}: greedy tokens {tokens.tolist()}; max relative logit error per step "
        + " ".join(f"{e:.1e}" for e in errs))
  assert max(errs) <= 1e-4, (family, errs)
  # Decoding without the rope delta (text positions right after the prompt's length)
  # gives other logits after the first step: the delta matters.
  _, no_delta = greedy(np.zeros_like(delta))
  miss = rel_err(no_delta[:2, 1], want[:2, 1])
  print(f"{family}: decoding without the rope delta {miss:.2e}")
  assert miss > 1e-2


def test_language_model_prefix_loads_the_same(families, tmp_path):
  """transformers' module names (model.language_model.*, model.visual.*) load to the
  same parameters as the saved names (model.*, visual.*)."""
  from safetensors.numpy import load_file, save_file
  src, _, model = families["qwen2_5_vl"]
  tensors = load_file(os.path.join(src, "model.safetensors"))
  renamed = {("model." + k if k.startswith("visual.") else
              k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
             for k, v in tensors.items()}
  assert "model.language_model.layers.0.self_attn.q_proj.bias" in renamed
  path = str(tmp_path / "renamed")
  os.makedirs(path)
  save_file(renamed, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(src, "config.json")) as f, \
      open(os.path.join(path, "config.json"), "w") as g:
    g.write(f.read())
  again, _ = qwen_vl.load(path)
  a = nnx.to_flat_state(nnx.state(again, nnx.Param))
  b = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  assert len(a) == len(b)
  for p, x in a:
    np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(b[p].get_value()))


@pytest.mark.parametrize("case,match", [
    ("shape", r"tensor model.layers.1.self_attn.k_proj.weight has shape \(16, 64\), "
              r"the config needs \(32, 64\)"),
    ("no_head", r"missing tensor\(s\) \['lm_head.weight'\]"),
    ("extra", r"unexpected tensor\(s\) \['model.layers.2.mlp.up_proj.weight'\]"),
    ("vision", r"tensor visual.merger.mlp.2.weight has shape \(48, 128\), "
               r"the config needs \(64, 128\)"),
])
def test_bad_checkpoints_name_the_tensor(families, tmp_path, case, match):
  from safetensors.numpy import load_file, save_file
  src, _, _ = families["qwen2_5_vl"]
  tensors = load_file(os.path.join(src, "model.safetensors"))
  if case == "shape":
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
  elif case == "no_head":
    del tensors["lm_head.weight"]
  elif case == "extra":
    tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((96, 64), np.float32)
  elif case == "vision":
    tensors["visual.merger.mlp.2.weight"] = np.zeros((48, 128), np.float32)
  path = str(tmp_path / case)
  os.makedirs(path)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(src, "config.json")) as f, \
      open(os.path.join(path, "config.json"), "w") as g:
    g.write(f.read())
  with pytest.raises(CheckpointError, match=match):
    qwen_vl.load(path)


def test_image_token_counts_are_checked(families):
  _, _, model = families["qwen2_vl"]
  ids, mask, pv, grid = prompts()
  config = model.config
  short = ids.copy()
  short[1, np.flatnonzero(short[1] == IMAGE)[-1]] = 5  # the second image loses a token
  with pytest.raises(ValueError, match=r"row 1: image 2 has 7 image-pad tokens at 24; its "
                                       r"image_grid_thw \(1, 8, 4\) makes 8 merged patches"):
    qwen_vl.mrope_positions(short, grid, config, mask)
  with pytest.raises(ValueError, match=r"row 1: a run of image-pad tokens at 24 has no image: "
                                       r"image_grid_thw has only 2 image\(s\)"):
    qwen_vl.mrope_positions(ids, grid[:2], config, mask)
  with pytest.raises(ValueError, match=r"image_grid_thw has 4 images; the prompts have 3 runs"):
    qwen_vl.mrope_positions(ids, np.concatenate([grid, grid[:1]]), config, mask)
  with pytest.raises(ValueError, match=r"the prompts have 37 image-pad tokens \(id 90\) but the "
                                       r"images have 38 merged patches"):
    model.embed(jnp.asarray(short), jnp.zeros((38, 64)))
  with pytest.raises(ValueError, match="must be host data"):
    nnx.jit(lambda m, t: m(t, jnp.ones(t.shape, bool)))(model, jnp.asarray(ids))


def test_released_style_configs_read_as_transformers_reads_them():
  """The released config.json layout: text keys at the top, rope_scaling {type: mrope},
  rope_theta at the top, tie_word_embeddings true (2B) or false (7B)."""
  flat = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
          "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
          "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 128000,
          "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768,
          "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
          "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
          "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                            "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                            "out_hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2,
                            "temporal_patch_size": 2, "window_size": 112,
                            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2}}
  ours = qwen_vl.config_from_hf(flat, dtype="bfloat16")
  theirs = transformers.Qwen2_5_VLConfig(**json.loads(json.dumps(flat)))
  t = theirs.text_config
  c = ours.text
  assert (c.vocab_size, c.width, c.depth, c.heads, c.kv_heads, c.mlp_width, c.norm_eps) == (
      t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads,
      t.num_key_value_heads, t.intermediate_size, t.rms_norm_eps)
  assert c.rope_theta == t.rope_parameters["rope_theta"] and t.rope_parameters["rope_type"] == (
      "default")
  assert list(c.mrope_section) == t.rope_parameters["mrope_section"]
  assert c.tie_embeddings == theirs.tie_word_embeddings is True
  assert (c.dim_per_head, c.qkv_bias, c.dtype, ours.vision.dtype) == (128, True, "bfloat16",
                                                                     "bfloat16")
  assert ours.image_token_id == theirs.image_token_id and ours.vision.out_width == 1536
  with pytest.raises(CheckpointError, match="use_sliding_window=true"):
    qwen_vl.config_from_hf({**flat, "use_sliding_window": True})


def test_decoder_mrope_option():
  """With mrope_section, three equal positions are plain RoPE (text tokens), which is
  also what 1-D positions give; the section must cover head dim / 2."""
  from knittrans_jax.models import hf
  from knittrans_jax.models.decoder import DecoderConfig, DecoderLM
  kw = dict(vocab_size=32, width=32, depth=1, heads=2, kv_heads=1, mlp_width=48, qkv_bias=True)
  config = DecoderConfig(**kw, mrope_section=(2, 3, 3))
  with nnx.use_eager_sharding(False):
    model = nnx.jit(lambda: DecoderLM(config, nnx.Rngs(0)))()  # one compile, not one per op
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 9)), jnp.int32)
  mask = jnp.asarray(np.arange(9)[None] >= np.array([[0], [4]]))
  run = nnx.jit(lambda m, p: m(tokens, mask, positions=p))
  base = np.asarray(run(model, None))
  same = jnp.broadcast_to(jnp.maximum(jnp.cumsum(mask, 1) - 1, 0), (3, 2, 9))
  np.testing.assert_allclose(np.asarray(run(model, same)), base, rtol=0,
                             atol=1e-6 * np.abs(base).max())
  # Later tokens' heights moved (RoPE is relative: moving all of them changes nothing);
  # at the default init's small weights the change is small, but far above rounding.
  moved = same.at[1, :, 6:].add(3)
  assert rel_err(np.asarray(run(model, moved))[mask], base[mask]) > 1e-5
  with pytest.raises(ValueError, match=r"mrope_section = \(2, 3, 2\) must be positive and sum "
                                       r"to head dim / 2 = 8"):
    DecoderConfig(**kw, mrope_section=(2, 3, 2))
  with pytest.raises(CheckpointError, match="cannot be written as a text-only checkpoint"):
    hf.config_to_hf(config, "float32")
