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
  loss, ratio, clipped = ppo_token_terms(logp, behaviour, adv, cfg)
  # A > 0: min(1.5 A, 1.3 A) = 1.3 (clipped high); ratio 0.5: min(0.5, 0.8) = 0.5 (not clipped).
  np.testing.assert_allclose(loss[0], [-1.3, -1.3, -0.5, -0.5], rtol=1e-6)
  np.testing.assert_array_equal(clipped[0], [1, 1, 0, 0])
  loss, _, clipped = ppo_token_terms(logp, behaviour, jnp.array([-1.0]), cfg)
  # A < 0: min(-1.5, -1.3) = -1.5 (not clipped); min(-0.5, -0.8) = -0.8 (clipped low).
  np.testing.assert_allclose(loss[0], [1.5, 1.5, 0.8, 0.8], rtol=1e-6)
  np.testing.assert_array_equal(clipped[0], [0, 0, 1, 1])


def test_kl_term_is_k3():
  cfg = LossConfig(kl_coef=0.5)
  logp, ref = jnp.array([[-1.0]]), jnp.array([[-2.0]])
  loss, _, _ = ppo_token_terms(logp, logp, jnp.array([0.0]), cfg, ref_logp=ref)
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
