"""Qwen2.5, Qwen3 and Llama 3 checkpoints: our decoder against transformers."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from hf_helpers import FAMILIES, make_checkpoint, padded_batch, torch_logits
from knittrans_jax.mesh import MeshConfig, make_mesh
from knittrans_jax.models import hf
from knittrans_jax.models.safetensors_io import SafetensorsError
from knittrans_jax.rollout.sampler import SamplerConfig, generate

FSDP_TP = MeshConfig(axes=(("fsdp", -1), ("tensor", 2)),
                     rules=(("batch", "fsdp"), ("embed", "fsdp"), ("heads", "tensor"),
                            ("mlp", "tensor"), ("vocab", "tensor")))


def rel_err(ours, theirs, mask):
  m = mask.astype(bool)
  return float(np.abs(ours[m] - theirs[m]).max() / np.abs(theirs[m]).max())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp(request.param))
  return request.param, path, make_checkpoint(request.param, path)


@pytest.mark.parametrize("attention", ["einsum", "xla"])
def test_logits_match_transformers_on_a_sharded_mesh(family, attention):
  name, path, theirs = family
  mesh = make_mesh(FSDP_TP)
  model, config = hf.load(path, dtype="float32", mesh=mesh, rules=FSDP_TP.rules,
                          attention=attention)
  assert config.family == name
  leaf = nnx.state(model, nnx.Param)["blocks"][0]["attn"]["q"]["kernel"].get_value()
  assert len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
  tokens, mask = padded_batch()
  ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))
  err = rel_err(ours, torch_logits(theirs, tokens, mask), mask)
  assert err <= 1e-4, f"{name}/{attention}: relative logit error {err:.2e}"


def test_greedy_decoding_matches_transformers_generate(family):
  name, path, theirs = family
  model, _ = hf.load(path)
  graphdef, params = nnx.split(model)
  prompts = [np.array([5, 9, 14, 3, 22], np.int32), np.array([7, 41, 8], np.int32)]
  cfg = SamplerConfig(max_new_tokens=16, greedy=True, stop_tokens=())
  ours = [o.tokens for o in generate(graphdef, params, prompts, jax.random.key(0), cfg)]
  P = 5
  ids = np.zeros((2, P), np.int64)
  att = np.zeros((2, P), np.int64)
  for i, p in enumerate(prompts):
    ids[i, P - len(p):], att[i, P - len(p):] = p, 1
  with torch.no_grad():
    out = theirs.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(att),
                          max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=0, eos_token_id=None).numpy()[:, P:]
  for i in range(2):
    np.testing.assert_array_equal(ours[i], out[i], err_msg=f"{name} row {i}")


def test_save_loads_in_transformers_to_the_same_logits(family, tmp_path):
  name, path, _ = family
  model, config = hf.load(path)
  out = str(tmp_path / "export")
  hf.save(model, config, out)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert type(reloaded).__name__ == hf.ARCHITECTURES[name]
  tokens, mask = padded_batch(seed=1)
  ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))
  assert rel_err(ours, torch_logits(reloaded, tokens, mask), mask) <= 1e-5



def test_scanned_layers_load_decode_and_export_exactly(family, tmp_path):
  """DecoderConfig.scan_layers: the blocks as one stacked module run by lax.scan. The
  same checkpoint loads into it on the sharded mesh to the unscanned model's logits,
  decodes as transformers does, and exports tensor for tensor what was loaded."""
  name, path, theirs = family
  mesh = make_mesh(FSDP_TP)
  model, config = hf.load(path, mesh=mesh, rules=FSDP_TP.rules, scan_layers=True, remat="full")
  leaf = nnx.state(model, nnx.Param)["blocks"]["attn"]["q"]["kernel"].get_value()
  assert leaf.shape[0] == config.depth and not leaf.sharding.is_fully_replicated
  assert leaf.sharding.spec[0] is None  # the layer axis is never split
  tokens, mask = padded_batch()
  ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))
  plain = np.asarray(hf.load(path, mesh=mesh, rules=FSDP_TP.rules)[0](jnp.asarray(tokens),
                                                                     jnp.asarray(mask)))
  assert rel_err(ours, plain, mask) <= 1e-6
  assert rel_err(ours, torch_logits(theirs, tokens, mask), mask) <= 1e-4
  graphdef, params = nnx.split(model)
  prompts = [np.array([5, 9, 14, 3, 22], np.int32), np.array([7, 41, 8], np.int32)]
  cfg = SamplerConfig(max_new_tokens=8, greedy=True, stop_tokens=())
  scanned = [o.tokens for o in generate(graphdef, params, prompts, jax.random.key(0), cfg)]
  unscanned = [o.tokens for o in generate(*nnx.split(hf.load(path)[0]), prompts,
                                          jax.random.key(0), cfg)]
  for a, b in zip(scanned, unscanned):
    np.testing.assert_array_equal(a, b)
  out = str(tmp_path / "export")
  hf.save(model, config, out)
  from safetensors.numpy import load_file
  src, dst = load_file(os.path.join(path, "model.safetensors")), load_file(
      os.path.join(out, "model.safetensors"))
  if config.tie_embeddings:  # transformers may write the tied head; we do not
    src.pop("lm_head.weight", None)
  assert sorted(src) == sorted(dst)
  for k in src:
    np.testing.assert_array_equal(src[k], dst[k], err_msg=k)

def test_sharded_save_and_bfloat16_round_trip(tmp_path):
  src = str(tmp_path / "src")
  theirs = make_checkpoint("qwen3", src, seed=3, dtype=torch.bfloat16)
  model, config = hf.load(src, dtype="bfloat16")
  assert config.param_dtype == "bfloat16"
  emb = np.asarray(nnx.state(model, nnx.Param)["embed"]["embedding"].get_value()).astype(np.float32)
  np.testing.assert_array_equal(emb, theirs.model.embed_tokens.weight.detach().float().numpy())
  out = str(tmp_path / "sharded")
  files = hf.save(model, config, out, max_shard_bytes=8 << 10)
  assert len(files) > 1 and os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  again, _ = hf.load(out, dtype="bfloat16")
  a = jax.tree.leaves(nnx.state(model, nnx.Param))
  b = jax.tree.leaves(nnx.state(again, nnx.Param))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _edit_config(path, **changes):
  fn = os.path.join(path, "config.json")
  cfg = json.load(open(fn))
  cfg.update(changes)
  json.dump(cfg, open(fn, "w"))


def _resave(path, drop=(), add=None, reshape=None):
  from safetensors.numpy import load_file, save_file
  fn = os.path.join(path, "model.safetensors")
  tensors = load_file(fn)
  for k in drop:
    tensors.pop(k)
  tensors.update(add or {})
  for k, shape in (reshape or {}).items():
    tensors[k] = np.zeros(shape, np.float32)
  save_file(tensors, fn, metadata={"format": "pt"})


@pytest.mark.parametrize("case,match", [
    ("unknown_arch", r"unknown architecture model_type='gpt2'"),
    ("missing", r"missing tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\]"),
    ("extra", r"unexpected tensor\(s\) \['model.layers.9.mlp.up_proj.weight'\]"),
    ("shape", r"tensor model.layers.0.self_attn.k_proj.weight has shape \(8, 32\), "
              r"the config needs \(16, 32\)"),
    ("truncated", r"truncated shard"),
    ("no_config", r"no config.json"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, case, match):
  path = str(tmp_path / "ckpt")
  make_checkpoint("llama", path)
  if case == "unknown_arch":
    _edit_config(path, model_type="gpt2")
  elif case == "missing":
    _resave(path, drop=["model.layers.1.mlp.up_proj.weight"])
  elif case == "extra":
    _resave(path, add={"model.layers.9.mlp.up_proj.weight": np.zeros((64, 32), np.float32)})
  elif case == "shape":
    _resave(path, reshape={"model.layers.0.self_attn.k_proj.weight": (8, 32)})
  elif case == "truncated":
    fn = os.path.join(path, "model.safetensors")
    with open(fn, "r+b") as f:
      f.truncate(os.path.getsize(fn) - 100)
  elif case == "no_config":
    os.remove(os.path.join(path, "config.json"))
  with pytest.raises((hf.CheckpointError, SafetensorsError), match=match):
    hf.load(path)


@pytest.mark.parametrize("name,count", [
    # transformers' num_parameters() of the released checkpoints.
    ("qwen2_5_0_5b", 494_032_768), ("qwen2_5_1_5b", 1_543_714_304),
    ("qwen2_5_7b", 7_615_616_512), ("qwen3_0_6b", 596_049_920), ("llama3_2_1b", 1_235_814_400)])
def test_model_configs_have_the_released_parameter_counts(name, count):
  import gin
  from knittrans_jax.models.decoder import DecoderConfig
  gin.clear_config()
  try:
    gin.parse_config_file(f"configs/models/{name}.gin")
    config = DecoderConfig()
  finally:
    gin.clear_config()
  abstract = hf.abstract_model(config)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert n == count
  assert config.scan_layers  # a run-time choice, not in config.json
  back = hf.config_from_hf(hf.config_to_hf(config, "bfloat16"), scan_layers=True)
  assert back == config


@pytest.mark.slow
def test_two_processes_each_read_their_own_slices(tmp_path):
  """Under jax.distributed each process reads only the slices its devices hold, the
  parameters are the checkpoint's, and hf.save from both writes one correct copy."""
  import socket
  import subprocess
  import sys
  ckpt = str(tmp_path / "ckpt")
  make_checkpoint("qwen3", ckpt, seed=2)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  procs = [subprocess.Popen([sys.executable, "tests/hf_load_proc.py", ckpt, str(port), str(p),
                             str(tmp_path)], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for p in range(2)]
  for p in procs:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
  stats = [json.load(open(tmp_path / f"proc{p}.json")) for p in range(2)]
  single, _ = hf.load(ckpt)
  want = float(sum(np.abs(np.asarray(x, np.float64)).sum()
                   for x in jax.tree.leaves(nnx.state(single, nnx.Param))))
  for s in stats:
    assert s["devices"] == 8
    assert s["checksum"] == pytest.approx(want, rel=1e-12)
    # fsdp over 8 devices, 4 per process: a process reads about half (norm scales and
    # biases, replicated, are read whole by both).
    assert 0.4 * s["total"] < s["read"] < 0.6 * s["total"], s
  again, _ = hf.load(str(tmp_path / "export"))
  for a, b in zip(jax.tree.leaves(nnx.state(single, nnx.Param)),
                  jax.tree.leaves(nnx.state(again, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tied_head_tensor_default_tying_and_resaving(tmp_path):
  """A tied checkpoint that also stores lm_head loads; a config.json without
  tie_word_embeddings means untied (transformers' default); saving over a directory
  leaves no stale shards to be read instead."""
  from safetensors.numpy import load_file, save_file
  tied = str(tmp_path / "tied")
  make_checkpoint("qwen2", tied, seed=4)
  fn = os.path.join(tied, "model.safetensors")
  tensors = load_file(fn)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  save_file(tensors, fn, metadata={"format": "pt"})
  model, config = hf.load(tied)
  assert config.tie_embeddings
  untied = str(tmp_path / "untied")
  make_checkpoint("qwen3", untied, seed=4)
  cfg = json.load(open(os.path.join(untied, "config.json")))
  cfg.pop("tie_word_embeddings")
  json.dump(cfg, open(os.path.join(untied, "config.json"), "w"))
  assert not hf.load(untied)[1].tie_embeddings
  out = str(tmp_path / "out")
  other, other_cfg = hf.load(untied)
  hf.save(other, other_cfg, out, max_shard_bytes=8 << 10)  # sharded, with an index
  hf.save(model, config, out)  # then one file over it
  assert sorted(f for f in os.listdir(out) if f.startswith("model")) == ["model.safetensors"]
  again, _ = hf.load(out)
  tokens, mask = padded_batch()
  np.testing.assert_array_equal(np.asarray(again(tokens, mask)), np.asarray(model(tokens, mask)))
