"""PPO-style clipped surrogate for GRPO, with a true global token mean.

All functions are pure and jit-friendly. Shapes: [B, T] per token, [B] per row.
Positions are aligned so that logp[:, t] is the log-prob of tokens[:, t] given the
tokens before it (position 0 and prompt positions carry mask 0).
"""
from __future__ import annotations

import dataclasses

import gin
import jax
import jax.numpy as jnp


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LossConfig:
  """clip_low/clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high]
  (DAPO's clip-higher uses a larger clip_high). kl_coef > 0 adds the k3 estimator
  of KL(policy || reference) per token; off by default."""
  clip_low: float = 0.2
  clip_high: float = 0.2
  kl_coef: float = 0.0
  normalize_adv_std: bool = True
  temperature: float = 1.0  # must equal the sampler's: log-probs of logits / temperature


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """log p(tokens[:, t] | tokens[:, :t]) and the entropy at each position, [B, T].

  logits[:, t] predicts tokens[:, t + 1]; position 0 has no prediction and gets 0.
  Computed in float32 whatever the logits' dtype (float64 if the logits are).
  """
  dt = jnp.promote_types(logits.dtype, jnp.float32)
  logp_all = jax.nn.log_softmax(logits[:, :-1].astype(dt), axis=-1)
  target = tokens[:, 1:]
  logp = jnp.take_along_axis(logp_all, target[..., None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  pad = jnp.zeros((tokens.shape[0], 1), dt)
  return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, entropy], axis=1)


def ppo_token_terms(logp: jax.Array, behaviour_logp: jax.Array, advantages: jax.Array,
                    config: LossConfig, ref_logp: jax.Array | None = None):
  """Per-token loss terms (to be summed under the mask) and the clip indicator."""
  ratio = jnp.exp(logp - behaviour_logp)
  adv = advantages[:, None]
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
  loss = -jnp.minimum(unclipped, clipped)
  if config.kl_coef and ref_logp is not None:
    d = ref_logp - logp
    loss = loss + config.kl_coef * (jnp.exp(d) - d - 1.0)
  was_clipped = (clipped < unclipped).astype(jnp.float32)
  return loss, ratio, was_clipped


def ppo_loss_sum(logits: jax.Array, batch: dict, config: LossConfig):
  """Sum over masked tokens of the PPO loss, plus metric sums (all unnormalised).

  Returning sums lets micro-batches and consumers be added up and divided once by
  the mini-batch's total token count: a true global token mean.
  """
  logp, entropy = token_logprobs(logits / config.temperature, batch["tokens"])
  mask = batch["loss_mask"].astype(logp.dtype)
  loss, ratio, clipped = ppo_token_terms(logp, batch["behaviour_logp"], batch["advantages"],
                                         config, batch.get("ref_logp"))
  sums = {
      "loss": jnp.sum(loss * mask),
      "clip_frac": jnp.sum(clipped * mask),
      "entropy": jnp.sum(entropy * mask),
      "ratio": jnp.sum(ratio * mask),
      # k1 estimate of KL(behaviour || policy): how far off-policy the data is.
      "behaviour_kl": jnp.sum((batch["behaviour_logp"] - logp) * mask),
      "tokens": jnp.sum(mask),
  }
  return sums["loss"], sums


def nll_loss_sum(logits: jax.Array, batch: dict):
  """Supervised objective (sum of -log p over masked tokens), for sanity runs."""
  logp, _ = token_logprobs(logits, batch["tokens"])
  mask = batch["loss_mask"].astype(logp.dtype)
  loss = -jnp.sum(logp * mask)
  return loss, {"loss": loss, "tokens": jnp.sum(mask)}
