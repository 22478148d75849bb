"""Loss pieces on hand-computed cases."""
import jax.numpy as jnp
import numpy as np
import pytest

from knittrans_jax.rl import LossConfig, group_advantages, ppo_loss_sum, ppo_token_terms, token_logprobs


def test_group_advantages_by_hand():
  r = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5], np.float32)
  a = group_advantages(r, 2)
  np.testing.assert_allclose(a, [1, -1, -1, 1, 0, 0], atol=1e-5)  # std of (1, 0) is 0.5
  np.testing.assert_allclose(group_advantages(r, 2, normalize_std=False), [.5, -.5, -.5, .5, 0, 0])
  np.testing.assert_allclose(np.asarray(group_advantages(jnp.asarray(r), 3)),
                             group_advantages(r, 3), atol=1e-6)
  with pytest.raises(ValueError, match="groups of 4"):
    group_advantages(r, 4)


def test_clipping_on_both_sides():
  cfg = LossConfig(clip_low=0.2, clip_high=0.3)
  behaviour = jnp.zeros((1, 4))
  logp = jnp.log(jnp.array([[1.5, 1.5, 0.5, 0.5]]))  # ratios 1.5, 1.5, 0.5, 0.5
  adv = jnp.array([1.0])
  loss, ratio, clipped, _ = ppo_token_terms(logp, behaviour, adv, cfg)
  # A > 0: min(1.5 A, 1.3 A) = 1.3 (clipped high); ratio 0.5: min(0.5, 0.8) = 0.5 (not clipped).
  np.testing.assert_allclose(loss[0], [-1.3, -1.3, -0.5, -0.5], rtol=1e-6)
  np.testing.assert_array_equal(clipped[0], [1, 1, 0, 0])
  loss, _, clipped, _ = ppo_token_terms(logp, behaviour, jnp.array([-1.0]), cfg)
  # A < 0: min(-1.5, -1.3) = -1.5 (not clipped); min(-0.5, -0.8) = -0.8 (clipped low).
  np.testing.assert_allclose(loss[0], [1.5, 1.5, 0.8, 0.8], rtol=1e-6)
  np.testing.assert_array_equal(clipped[0], [0, 0, 1, 1])


def test_kl_term_is_k3():
  cfg = LossConfig(kl_coef=0.5)
  logp, ref = jnp.array([[-1.0]]), jnp.array([[-2.0]])
  loss, _, _, _ = ppo_token_terms(logp, logp, jnp.array([0.0]), cfg, ref_logp=ref)
  d = -1.0
  np.testing.assert_allclose(loss[0, 0], 0.5 * (np.exp(d) - d - 1), rtol=1e-6)


def test_token_logprobs_alignment_and_entropy():
  logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3] * 3]]))
  tokens = jnp.array([[2, 0, 1]])
  logp, ent = token_logprobs(logits, tokens)
  # position 1 is predicted by logits[0], position 2 by logits[1]; position 0 has none.
  np.testing.assert_allclose(logp[0], [0, np.log(0.5), np.log(0.8)], rtol=1e-6)
  h0 = -(0.5 * np.log(0.5) + 2 * 0.25 * np.log(0.25))
  np.testing.assert_allclose(ent[0, 1], h0, rtol=1e-6)


def test_masks_and_the_global_token_mean():
  # Two micro-batches with 1 and 3 loss tokens: the global mean weights tokens, not
  # micro-batches: (l1 + l2 + l3 + l4) / 4, not (l1 / 1 + (l2 + l3 + l4) / 3) / 2.
  V = 4
  logits = jnp.zeros((1, 5, V))  # uniform: logp = -log 4 everywhere
  cfg = LossConfig()
  def micro(mask, adv):
    return dict(tokens=jnp.zeros((1, 5), jnp.int32), loss_mask=jnp.array([mask], jnp.float32),
                behaviour_logp=jnp.full((1, 5), -np.log(V), jnp.float32),
                advantages=jnp.array([adv], jnp.float32))
  s1, m1 = ppo_loss_sum(logits, micro([0, 1, 0, 0, 0], 2.0), cfg)
  s2, m2 = ppo_loss_sum(logits, micro([0, 1, 1, 1, 0], -1.0), cfg)
  assert float(m1["tokens"]) == 1 and float(m2["tokens"]) == 3
  global_mean = (s1 + s2) / 4  # ratio 1: per-token loss is -A
  np.testing.assert_allclose(global_mean, (-2.0 + 3.0) / 4, rtol=1e-6)
  assert not np.isclose(global_mean, (s1 / 1 + s2 / 3) / 2)
  # Masked-out tokens contribute nothing, whatever their values.
  b = micro([0, 1, 0, 0, 0], 2.0)
  b["behaviour_logp"] = b["behaviour_logp"].at[0, 3].set(100.0)
  np.testing.assert_allclose(ppo_loss_sum(logits, b, cfg)[0], s1)


def test_behaviour_corrections_by_hand():
  """truncate scales a token by min(1, is_high / r) (no gradient through the scale);
  mask zeroes tokens with r outside [is_low, is_high], gradient included."""
  import jax
  behaviour = jnp.zeros((1, 4))
  logp = jnp.log(jnp.array([[4.0, 1.0, 0.25, 1.1]]))  # ratios 4, 1, 0.25, 1.1
  adv = jnp.array([-1.0])  # A < 0: no clipping of the large ratio (min picks r A)
  base = LossConfig(clip_low=0.2, clip_high=0.2)
  plain, _, _, _ = ppo_token_terms(logp, behaviour, adv, base)
  np.testing.assert_allclose(plain[0], [4.0, 1.0, 0.8, 1.1], rtol=1e-6)
  trunc = LossConfig(clip_low=0.2, clip_high=0.2, behaviour_correction="truncate", is_high=2.0)
  loss, _, _, _ = ppo_token_terms(logp, behaviour, adv, trunc)
  np.testing.assert_allclose(loss[0], [2.0, 1.0, 0.8, 1.1], rtol=1e-6)  # 4 x (2 / 4)
  # d/dlogp of r * A * sg(2 / r) at r = 4: A * r * (2 / r) = -2 (the capped weight).
  g = jax.grad(lambda lp: ppo_token_terms(lp, behaviour, adv, trunc)[0].sum())(logp)
  np.testing.assert_allclose(g[0, 0], 2.0, rtol=1e-6)  # loss = -min(...) * w: d = -A r w
  mask = LossConfig(clip_low=0.2, clip_high=0.2, behaviour_correction="mask", is_low=0.5,
                    is_high=2.0)
  loss, _, _, _ = ppo_token_terms(logp, behaviour, adv, mask)
  np.testing.assert_allclose(loss[0], [0.0, 1.0, 0.0, 1.1], rtol=1e-6)
  g = jax.grad(lambda lp: ppo_token_terms(lp, behaviour, adv, mask)[0].sum())(logp)
  assert g[0, 0] == 0 and g[0, 2] == 0 and g[0, 1] != 0
  # The KL penalty is not corrected: a masked token keeps its k3 term.
  ref = jnp.zeros((1, 4))
  kl = LossConfig(clip_low=0.2, clip_high=0.2, behaviour_correction="mask", kl_coef=0.5)
  loss, _, _, _ = ppo_token_terms(logp, behaviour, adv, kl, ref)
  d = -np.log(4.0)
  np.testing.assert_allclose(loss[0, 0], 0.5 * (np.exp(d) - d - 1), rtol=1e-5)
  with pytest.raises(ValueError, match="behaviour_correction = 'tis'"):
    LossConfig(behaviour_correction="tis")
  with pytest.raises(ValueError, match="is_low 1.5"):
    LossConfig(is_low=1.5)


def test_lag0_engine_vs_trainer_sums_by_hand():
  """Rows generated wholly by the parameters' version count; a max merges as a max."""
  from knittrans_jax.job.metrics import engine_vs_trainer
  from knittrans_jax.rl.losses import merge_sums
  tokens = jnp.array([[0, 1, 2], [0, 3, 4], [0, 5, 6]])
  logits = jnp.zeros((3, 3, 8))  # uniform: every log-prob is -log 8
  lp = -np.log(8.0)
  batch = {"tokens": tokens, "loss_mask": jnp.array([[0, 1, 1]] * 3, jnp.float32),
           "behaviour_logp": jnp.array([[0, lp + 0.1, lp - 0.3], [0, lp + 1, lp], [0, lp, lp + 5]]),
           "advantages": jnp.ones(3), "version_first": jnp.array([7, 6, 7]),
           "version_last": jnp.array([7, 7, 8])}
  _, sums = ppo_loss_sum(logits, batch, LossConfig(), version=7)
  # Only row 0 is lag 0 (row 1 began at 6, row 2 ended at 8).
  np.testing.assert_allclose([sums["fresh_tokens"], sums["fresh_logp_abs_diff"],
                              sums["max_fresh_logp_abs_diff"]], [2, 0.4, 0.3], rtol=1e-5)
  merged = merge_sums(sums, {**sums, "max_fresh_logp_abs_diff": jnp.float32(0.9)})
  assert float(merged["max_fresh_logp_abs_diff"]) == pytest.approx(0.9)
  assert float(merged["fresh_tokens"]) == 4
  m = engine_vs_trainer(merged)
  assert m["lag0_tokens"] == 4 and m["logprob_abs_diff_mean"] == pytest.approx(0.2)
  assert m["logprob_abs_diff_max"] == pytest.approx(0.9)
  ratios = np.exp(-np.array([0.1, -0.3, 1, 0, 0, 5]))
  assert m["ratio_std"] == pytest.approx(ratios.std(), rel=1e-4)
  _, no_version = ppo_loss_sum(logits, batch, LossConfig())
  assert "fresh_tokens" not in no_version
  assert engine_vs_trainer(no_version)["logprob_abs_diff_max"] is None


def _tiny_decoder(tie: bool):
  from flax import nnx

  from knittrans_jax.models import DecoderConfig, DecoderLM
  cfg = DecoderConfig(vocab_size=96, width=32, depth=1, heads=2, mlp_width=64, tie_embeddings=tie)
  with nnx.use_eager_sharding(False):
    return DecoderLM(cfg, nnx.Rngs(0))


@pytest.mark.parametrize("tie,chunk", [(False, 4), (True, 5), (False, 64)])
def test_chunked_logprobs_equal_the_full_ones_gradients_included(tie, chunk):
  """The train step's log-probs from the hidden states in chunks (no [B, T, V] array)
  equal those of the full logits, values and gradients, to float32 round-off; with
  T - 1 = 15 predicted positions, chunks of 4 and 5 leave a padded last chunk."""
  import jax
  from flax import nnx

  from knittrans_jax.rl.losses import chunked_token_logprobs
  model = _tiny_decoder(tie)
  graphdef, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 96, (3, 16)), jnp.int32)
  mask = jnp.ones((3, 16), jnp.int32).at[2, 12:].set(0)
  weights = jnp.asarray(rng.normal(size=(3, 16)), jnp.float32)

  def full(p):
    logits = nnx.merge(graphdef, p)(tokens, mask)
    lp, ent = token_logprobs(logits / 0.7, tokens)
    return jnp.sum(lp * weights) + jnp.sum(ent), (lp, ent)

  def chunked(p):
    hidden = nnx.merge(graphdef, p)(tokens, mask, hidden=True)
    lp, ent = chunked_token_logprobs(hidden, tokens, 0.7, chunk)
    return jnp.sum(lp * weights) + jnp.sum(ent), (lp, ent)

  (v_full, (lp_f, ent_f)), g_full = jax.value_and_grad(full, has_aux=True)(params)
  (v_chunk, (lp_c, ent_c)), g_chunk = jax.value_and_grad(chunked, has_aux=True)(params)
  np.testing.assert_allclose(lp_c, lp_f, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent_c, ent_f, rtol=1e-5, atol=1e-5)
  assert float(lp_c[0, 0]) == 0.0 and float(ent_c[0, 0]) == 0.0  # position 0 predicts nothing
  np.testing.assert_allclose(v_chunk, v_full, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_chunk), jax.tree.leaves(g_full)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_loss_forms_no_vocab_sized_sequence_array():
  """No activation in the gradient's program has both the sequence and the vocabulary
  axes: at most one chunk's [B, chunk, V] logits exist."""
  import jax
  from flax import nnx

  from knittrans_jax.train.program_arrays import largest_vocab_activation
  from knittrans_jax.train.step import text_forward
  model = _tiny_decoder(False)
  graphdef, params = nnx.split(model, nnx.Param)
  B, T, V, chunk = 2, 64, 96, 8
  batch = {"tokens": jnp.zeros((B, T), jnp.int32), "attention_mask": jnp.ones((B, T), jnp.int32),
           "loss_mask": jnp.ones((B, T), jnp.int32), "behaviour_logp": jnp.zeros((B, T)),
           "advantages": jnp.ones((B,))}
  cfg = LossConfig(logprob_chunk=chunk)

  def loss(p):
    return ppo_loss_sum(text_forward(nnx.merge(graphdef, p), batch), batch, cfg)[0]

  def full(p):  # the logits path, for contrast
    return ppo_loss_sum(nnx.merge(graphdef, p)(batch["tokens"], batch["attention_mask"]),
                        batch, cfg)[0]

  assert largest_vocab_activation(jax.grad(loss), params, vocab=V) == (B, chunk, V)
  assert largest_vocab_activation(jax.grad(full), params, vocab=V) == (B, T, V)
