"""DecoderConfig's memory and attention knobs change cost, not results."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knittrans_jax.models import DecoderConfig, DecoderLM

BASE = dict(vocab_size=64, width=32, depth=3, heads=4, kv_heads=2, head_dim=16, mlp_width=64,
            qkv_bias=True, qk_norm=True, tie_embeddings=True, rope_type="llama3",
            rope_factor=8.0, rope_original_max_positions=16)


def batch():
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, 64, (2, 10)), jnp.int32)
  mask = jnp.asarray(np.arange(10)[None] >= np.array([[0], [3]]))  # row 1 left-padded
  return tokens, mask


def loss_and_grads(**kw):
  with nnx.use_eager_sharding(False):
    model = DecoderLM(DecoderConfig(**{**BASE, **kw}), nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tokens, mask = batch()

  def loss(p):
    logits = nnx.merge(graphdef, p)(tokens, mask)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * mask)
  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("kw", [dict(remat="full"), dict(remat="dots"), dict(attention="xla"),
                                dict(attention="auto"),
                                dict(attention="blockwise", attention_block=4, remat="full")])
def test_same_loss_and_gradients(kw):
  (l0, g0), (l1, g1) = loss_and_grads(), loss_and_grads(**kw)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


def test_bfloat16_stays_close_to_float32():
  """bfloat16 activations on float32 parameters: the loss moves by rounding only. With
  bfloat16 parameters too, gradients come back in bfloat16 (the initial values
  differ: the initializer draws in the parameter dtype)."""
  (l0, _), (l1, g1) = loss_and_grads(), loss_and_grads(dtype="bfloat16")
  assert abs(float(l1) - float(l0)) <= 0.005 * abs(float(l0))
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g1))
  _, g2 = loss_and_grads(dtype="bfloat16", param_dtype="bfloat16")
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(g2))


def test_kv_cache_decoding_matches_the_full_forward():
  """GQA caches hold kv_heads; prefill + decode_step give the full forward's logits."""
  with nnx.use_eager_sharding(False):
    model = DecoderLM(DecoderConfig(**BASE), nnx.Rngs(1))
  tokens, mask = batch()
  full = model(tokens, mask)
  P = 6
  logits, caches = model.prefill(tokens[:, :P], mask[:, :P], capacity=10)
  assert caches[0][0].shape == (2, 10, 2, 16)
  np.testing.assert_allclose(logits, full[:, P - 1], rtol=1e-5, atol=1e-5)
  key_valid = jnp.concatenate([mask[:, :P], jnp.zeros((2, 4), bool)], axis=1)
  for t in range(P, 10):
    key_valid = key_valid.at[:, t].set(True)
    position = jnp.sum(mask[:, :t], axis=1).astype(jnp.int32)
    logits, caches = model.decode_step(tokens[:, t], position, caches, t, key_valid)
    np.testing.assert_allclose(logits, full[:, t], rtol=1e-5, atol=1e-5)


def test_bad_configs_name_the_field():
  with pytest.raises(ValueError, match=r"heads 4 is not a multiple of kv_heads 3"):
    DecoderConfig(**{**BASE, "kv_heads": 3})
  with pytest.raises(ValueError, match=r"DecoderConfig.remat = 'some' is not one of"):
    DecoderConfig(**{**BASE, "remat": "some"})
  with pytest.raises(ValueError, match=r"DecoderConfig.attention = 'flash' is not one of"):
    DecoderConfig(**{**BASE, "attention": "flash"})
  with pytest.raises(ValueError, match=r"DecoderConfig.attention_block = 0 must be positive"):
    DecoderConfig(**{**BASE, "attention_block": 0})


def stacked_copy(model, **kw):
  """A scan_layers model holding `model`'s parameters, each block's stacked."""
  from knittrans_jax.models import scan
  with nnx.use_eager_sharding(False):
    out = DecoderLM(DecoderConfig(**{**BASE, "scan_layers": True, **kw}), nnx.Rngs(0))
  mine = {p: get() for p, _, get in scan.layer_entries(nnx.state(model, nnx.Param))}
  flat = []
  for path, v in nnx.to_flat_state(nnx.state(out, nnx.Param)):
    if scan.is_stacked(path):
      flat.append((path, v.replace(jnp.stack([mine[("blocks", i) + tuple(path[1:])]
                                              for i in range(BASE["depth"])]))))
    else:
      flat.append((path, v.replace(mine[tuple(path)])))
  nnx.update(out, nnx.from_flat_state(flat))
  return out


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scanned_layers_same_loss_gradients_and_decoding(remat):
  """scan_layers: one lax.scan over stacked blocks (models/scan.py), each remat policy:
  the unscanned model's loss, per-layer gradients and KV-cache decoding."""
  from knittrans_jax.models import scan
  with nnx.use_eager_sharding(False):
    plain = DecoderLM(DecoderConfig(**BASE), nnx.Rngs(0))
  scanned = stacked_copy(plain, remat=remat)
  tokens, mask = batch()

  def value_and_grads(model):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
      logits = nnx.merge(graphdef, p)(tokens, mask)
      return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * mask)
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, {p: np.asarray(get()) for p, _, get in scan.layer_entries(grads)}
  (l0, g0), (l1, g1) = value_and_grads(plain), value_and_grads(scanned)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  assert sorted(g0) == sorted(g1) and any(p[0] == "blocks" and p[1] == 2 for p in g1)
  for p in g0:
    np.testing.assert_allclose(g1[p], g0[p], rtol=1e-5, atol=1e-5 * float(np.abs(g0[p]).max()),
                               err_msg=str(p))
  P = 6
  (la, ca), (lb, cb) = (m.prefill(tokens[:, :P], mask[:, :P], capacity=10)
                        for m in (plain, scanned))
  assert cb[0].shape == (BASE["depth"], 2, 10, 2, 16)  # one stacked (k, v)
  np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)
  key_valid = jnp.concatenate([mask[:, :P], jnp.ones((2, 1), bool), jnp.zeros((2, 3), bool)], 1)
  position = jnp.sum(mask[:, :P], axis=1).astype(jnp.int32)
  (da, _), (db, _) = (m.decode_step(tokens[:, P], position, c, P, key_valid)
                      for m, c in ((plain, ca), (scanned, cb)))
  np.testing.assert_allclose(db, da, rtol=1e-5, atol=1e-5)
