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

from knittrans_jax.hidden import Hidden
from knittrans_jax.mesh import constrain

CORRECTIONS = ("none", "truncate", "mask")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LossConfig:
  """clip_low/clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high]
  (DAPO's clip-higher uses a larger clip_high). kl_coef > 0 adds the k3 estimator
  of KL(policy || reference) per token; off by default.

  behaviour_correction: what to do with tokens whose ratio r = pi/mu (trainer policy
  over the rollout engine's behaviour log-prob) is far from 1, which an engine's
  numerics and the staleness both cause (off by default):
    'none'      the clipped surrogate as is;
    'truncate'  truncated importance sampling: each token's surrogate is scaled by
                sg(min(1, is_high / r)), so no token weighs more than is_high;
    'mask'      tokens with r outside [is_low, is_high] get no surrogate gradient
                (the term is 0; they still count in the token mean).
  Neither touches the KL penalty.
  """
  clip_low: float = 0.2
  clip_high: float = 0.2
  kl_coef: float = 0.0
  normalize_adv_std: bool = True
  temperature: float = 1.0  # must equal the sampler's: log-probs of logits / temperature
  # Tokens per chunk of the chunked log-probs (a model that returns `Hidden`): one
  # chunk's [B, chunk, vocab] logits exist at a time, forward and backward.
  logprob_chunk: int = 256
  behaviour_correction: str = "none"
  is_low: float = 0.5
  is_high: float = 2.0

  def __post_init__(self):
    if self.behaviour_correction not in CORRECTIONS:
      raise ValueError(f"LossConfig.behaviour_correction = {self.behaviour_correction!r}: use "
                       f"one of {CORRECTIONS}")
    if not isinstance(self.logprob_chunk, int) or self.logprob_chunk <= 0:
      raise ValueError(f"LossConfig.logprob_chunk = {self.logprob_chunk!r} must be a positive int")
    if not 0 < self.is_low <= 1 <= self.is_high:
      raise ValueError(f"LossConfig: is_low {self.is_low} and is_high {self.is_high} must "
                       "satisfy 0 < is_low <= 1 <= is_high")


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


def chunked_token_logprobs(hidden: Hidden, tokens: jax.Array, temperature: float = 1.0,
                           chunk: int = 256) -> tuple[jax.Array, jax.Array]:
  """token_logprobs(project(states) / temperature, tokens) without the [B, T, V]
  logits: the token axis is cut into chunks of `chunk` positions, mapped one at a
  time (lax.map), each chunk's logits rematerialised in the backward pass
  (jax.checkpoint), so at most one chunk's [B, chunk, V] exists. Same values to
  round-off, gradients included (tests/test_rl_losses.py)."""
  h, project = hidden.states, hidden.project
  B, T, D = h.shape
  n = T - 1  # positions 0..T-2 predict tokens 1..T-1
  c = max(1, min(chunk, n))
  k = -(-n // c)
  pad = k * c - n
  hs = jnp.pad(h[:, :-1], ((0, 0), (0, pad), (0, 0))).reshape(B, k, c, D).swapaxes(0, 1)
  ts = jnp.pad(tokens[:, 1:], ((0, 0), (0, pad))).reshape(B, k, c).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    hc, tc = args
    logits = constrain(project(hc), "activation_batch", "activation_length",
                       "activation_vocab") / temperature
    dt = jnp.promote_types(logits.dtype, jnp.float32)
    logp_all = jax.nn.log_softmax(logits.astype(dt), axis=-1)
    logp = jnp.take_along_axis(logp_all, tc[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)

  logp, entropy = jax.lax.map(one, (hs, ts))  # [k, B, c] each
  logp, entropy = (x.swapaxes(0, 1).reshape(B, k * c)[:, :n] for x in (logp, entropy))
  zero = jnp.zeros((B, 1), logp.dtype)
  return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, entropy], axis=1)


def _logprobs(outputs, tokens, temperature: float, chunk: int):
  """Per-token log-probs and entropies from a model's outputs: logits [B, T, V], or
  `Hidden` (computed in chunks, no vocab-sized array)."""
  if isinstance(outputs, Hidden):
    return chunked_token_logprobs(outputs, tokens, temperature, chunk)
  return token_logprobs(outputs / temperature, tokens)


def logprobs_of(outputs, tokens, config: LossConfig):
  """(log-probs, entropies) [B, T] of a model's outputs as the loss computes them."""
  return _logprobs(outputs, tokens, config.temperature, config.logprob_chunk)


def ppo_token_terms(logp: jax.Array, behaviour_logp: jax.Array, advantages: jax.Array,
                    config: LossConfig, ref_logp: jax.Array | None = None):
  """Per-token loss terms (to be summed under the mask) and the clip indicator.
  `advantages`: per row [B], or per token [B, T] (a packed batch)."""
  ratio = jnp.exp(logp - behaviour_logp)
  adv = advantages if advantages.ndim == 2 else advantages[:, None]
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
  loss = -jnp.minimum(unclipped, clipped)
  # The corrections weigh the surrogate only, not the KL penalty below.
  if config.behaviour_correction == "truncate":
    loss = loss * jax.lax.stop_gradient(jnp.minimum(1.0, config.is_high / ratio))
  elif config.behaviour_correction == "mask":
    keep = (ratio >= config.is_low) & (ratio <= config.is_high)
    loss = jnp.where(jax.lax.stop_gradient(keep), loss, 0.0)
  if config.kl_coef and ref_logp is not None:
    d = ref_logp - logp
    loss = loss + config.kl_coef * (jnp.exp(d) - d - 1.0)
  was_clipped = (clipped < unclipped).astype(jnp.float32)
  return loss, ratio, was_clipped


def merge_sums(a: dict, b: dict) -> dict:
  """Two micro-batches' metric sums: added, except 'max_*' entries (maxima)."""
  return {k: jnp.maximum(a[k], b[k]) if k.startswith("max_") else a[k] + b[k] for k in a}


def ppo_loss_sum(outputs, batch: dict, config: LossConfig, version=None):
  """Sum over masked tokens of the PPO loss, plus metric sums (all unnormalised).
  `outputs`: the model's logits, or its `Hidden` states (chunked log-probs).

  Returning sums lets micro-batches and consumers be added up and divided once by
  the mini-batch's total token count: a true global token mean (`merge_sums`).

  With `version` (the parameters' policy version) and the batch's per-row
  `version_first`/`version_last`, the sums also measure the engine against the
  trainer on the tokens at version lag 0 (rows generated wholly by these parameters):
  |logp - behaviour_logp| summed and its maximum. At top_p < 1 that difference also
  holds the log of the nucleus's mass (the behaviour distribution is truncated).
  """
  logp, entropy = logprobs_of(outputs, batch["tokens"], config)
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
      # (r - 1)^2, not r^2: its sum keeps the spread of ratios near 1 in float32.
      "ratio_dev_sq": jnp.sum(jnp.square(ratio - 1.0) * mask),
  }
  if config.kl_coef and "ref_logp" in batch:  # the k3 estimate of KL(policy || reference)
    d = batch["ref_logp"] - logp
    sums["kl"] = jnp.sum((jnp.exp(d) - d - 1.0) * mask)
  if config.behaviour_correction != "none":
    corrected = ratio > config.is_high
    if config.behaviour_correction == "mask":
      corrected = corrected | (ratio < config.is_low)
    sums["corrected"] = jnp.sum(corrected * mask)
  if version is not None and "version_first" in batch:
    fresh = (batch["version_first"] == version) & (batch["version_last"] == version)
    fresh = fresh if fresh.ndim == 2 else fresh[:, None]  # per token when packed
    fresh_mask = mask * fresh.astype(mask.dtype)
    diff = jnp.abs(logp - batch["behaviour_logp"]) * fresh_mask
    sums.update(fresh_tokens=jnp.sum(fresh_mask), fresh_logp_abs_diff=jnp.sum(diff),
                max_fresh_logp_abs_diff=jnp.max(diff))
  return sums["loss"], sums


def nll_loss_sum(outputs, batch: dict, chunk: int = 256):
  """Supervised objective (sum of -log p over masked tokens), for sanity runs."""
  logp, _ = _logprobs(outputs, batch["tokens"], 1.0, chunk)
  mask = batch["loss_mask"].astype(logp.dtype)
  loss = -jnp.sum(logp * mask)
  return loss, {"loss": loss, "tokens": jnp.sum(mask)}
