"""Policy losses per token and their aggregation (LossConfig.policy_loss, .aggregation).

Pure functions over [B, T] arrays. Log-probs: `logp` is the current policy's (the
trainer's forward, with gradient), `behaviour_logp` the rollout engine's (what
sampled the tokens); the ratio r = exp(logp - behaviour_logp). `seq_ids` names each
token's sequence (`sequence_ids`: a padded row is one sequence, a packed row holds
several segments), so sequence-level quantities are the same padded or packed.

  ppo    l_t = -min(r_t A, clip(r_t, 1 - e_lo, 1 + e_hi) A)        (Schulman et al.
         2017, eq. 7; DAPO's clip-higher: e_hi > e_lo, Yu et al. 2025, eq. 10)
  gspo   s_i = exp(mean_{t in i} log r_t), the sequence's length-normalised ratio;
         l_t = -min(s_it A, clip(s_it, 1 - e_lo, 1 + e_hi) A), with
         s_it = sg(s_i) r_t / sg(r_t) (value s_i, gradient s_i grad log pi_t: the
         GSPO-token form)                                         (Zheng et al. 2025,
         "Group Sequence Policy Optimization", eqs. 5-7 and 13)
  cispo  l_t = -sg(clip(r_t, 1 - e_lo, 1 + e_hi)) A log pi_t: the IS weight clipped
         and stopped, so no token loses its gradient          (MiniMax 2025,
         "MiniMax-M1", eq. 4)
  decoupled_ppo  PPO's clip against a proximal policy pi_prox, weighted by the
         behaviour ratio sg(min(pi_prox / mu, is_high)) (Fu et al. 2025, "AReaL",
         eq. 5). Which log-probs: mu the engine's (behaviour_logp), pi the current
         forward's (logp), pi_prox the parameters at the start of the mini-batch's
         update. One optimizer step per mini-batch (this trainer) makes pi_prox the
         current parameters: its log-probs are sg(logp), from the forward the step
         runs anyway, so the extra forward AReaL pays is 0 here; the clip then bounds
         nothing at the first and only update, and the behaviour weight does the work.

Behaviour corrections (`correction_weights`, LossConfig.behaviour_correction): a
stopped weight on each token's policy term from the ratios r = pi / mu of the engine's
behaviour log-probs, which staleness and the engine's numerics both move off 1.
S_i = exp(sum_{t in i} log r_t) is the sequence's ratio, G_i = exp(mean_{t in i} log
r_t) its geometric mean; [lo, hi] = [is_low, is_high]:
  truncate      token TIS: w_t = min(1, hi / r_t)         (Yao et al. 2025, "Your
                efficient RL framework secretly brings you off-policy RL training")
  mask, icepop  token mask: w_t = [lo <= r_t <= hi]        (IcePop, Ling Team 2025: the
                two-sided mask of the train/inference mismatch; 'icepop' names it)
  seq_truncate  sequence TIS: w_t = min(1, hi / S_i)       (verl's rollout_corr,
                sequence level)
  seq_mask      masked IS (MIS) at the sequence level: w_t = [lo <= S_i <= hi]
  geo_reject    geometric-mean rejection: w_t = [lo <= G_i <= hi] (verl's geometric
                rejection; a long sequence is not rejected for its length alone)

Aggregation (`token_weights`: the weight of each token's term in the loss sum; the
sum is divided by LossConfig.normaliser):
  token_mean  weight = mask; / the mini-batch's loss tokens
  seq_mean    weight = mask / |sequence|; / the mini-batch's sequences
  constant    weight = mask; / (sequences x norm_len)     (Dr. GRPO, Liu et al. 2025)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

sg = jax.lax.stop_gradient
POLICY_LOSSES = ("ppo", "gspo", "cispo", "decoupled_ppo")


def sequence_ids(mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
  """Each token's sequence, unique over the batch [B, T]: row * T + its segment (a
  packed row's `segment_ids`; 0 for a padded row, one sequence)."""
  B, T = mask.shape
  seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  return jnp.arange(B, dtype=jnp.int32)[:, None] * T + seg


def seq_sum(x: jax.Array, seq_ids: jax.Array) -> jax.Array:
  """Per token, the sum of `x` over its sequence ([B, T] -> [B, T])."""
  n = seq_ids.size
  totals = jax.ops.segment_sum(x.reshape(-1), seq_ids.reshape(-1), num_segments=n)
  return totals[seq_ids]


def seq_mean(x: jax.Array, mask: jax.Array, seq_ids: jax.Array) -> jax.Array:
  """Per token, the mean of `x` over its sequence's masked tokens (0 where none)."""
  return seq_sum(x * mask, seq_ids) / jnp.maximum(seq_sum(mask, seq_ids), 1.0)


def policy_terms(kind: str, logp, behaviour_logp, adv, mask, seq_ids, clip_low: float,
                 clip_high: float, cap: float = 2.0):
  """(per-token loss, per-token ratio r_t, clipped indicator) of policy loss `kind`;
  `cap`: decoupled PPO's bound on its behaviour weight (LossConfig.is_high)."""
  log_r = logp - behaviour_logp
  ratio = jnp.exp(log_r)
  lo, hi = 1.0 - clip_low, 1.0 + clip_high
  if kind == "ppo":
    unclipped, clipped = ratio * adv, jnp.clip(ratio, lo, hi) * adv
    return -jnp.minimum(unclipped, clipped), ratio, (clipped < unclipped).astype(jnp.float32)
  if kind == "gspo":
    s = jnp.exp(seq_mean(log_r, mask, seq_ids))
    s_t = sg(s) * jnp.exp(logp - sg(logp))
    unclipped, clipped = s_t * adv, jnp.clip(s_t, lo, hi) * adv
    return -jnp.minimum(unclipped, clipped), ratio, (clipped < unclipped).astype(jnp.float32)
  if kind == "decoupled_ppo":
    prox = sg(logp)  # the proximal policy: these parameters, before the update
    r_prox = jnp.exp(logp - prox)
    unclipped, clipped = r_prox * adv, jnp.clip(r_prox, lo, hi) * adv
    behaviour_w = sg(jnp.minimum(jnp.exp(prox - behaviour_logp), cap))
    return (-jnp.minimum(unclipped, clipped) * behaviour_w, ratio,
            (clipped < unclipped).astype(jnp.float32))
  if kind == "cispo":
    weight = sg(jnp.clip(ratio, lo, hi))
    return -weight * adv * logp, ratio, ((ratio < lo) | (ratio > hi)).astype(jnp.float32)
  raise ValueError(f"LossConfig.policy_loss = {kind!r}: use one of {POLICY_LOSSES}")


TOKEN_CORRECTIONS = ("truncate", "mask", "icepop")
SEQUENCE_CORRECTIONS = ("seq_truncate", "seq_mask", "geo_reject")


def correction_weights(kind: str, log_r, mask, seq_ids, is_low: float, is_high: float):
  """(stopped weight on each token's policy term, corrected indicator) of behaviour
  correction `kind` (module doc); 'none': weight 1, nothing corrected."""
  log_r = sg(log_r)
  if kind == "none":
    return jnp.ones_like(log_r), jnp.zeros_like(log_r)
  if kind in TOKEN_CORRECTIONS:
    r = jnp.exp(log_r)
  else:  # the sequence's ratio or its geometric mean, on every token of it
    total = seq_sum(log_r * mask, seq_ids)
    r = jnp.exp(total if kind != "geo_reject" else
                total / jnp.maximum(seq_sum(mask, seq_ids), 1.0))
  if kind in ("truncate", "seq_truncate"):
    return jnp.minimum(1.0, is_high / r), (r > is_high).astype(log_r.dtype)
  keep = (r >= is_low) & (r <= is_high)
  return keep.astype(log_r.dtype), (~keep).astype(log_r.dtype)


def token_weights(aggregation: str, mask: jax.Array, seq_ids: jax.Array) -> jax.Array:
  """Each token's weight in the loss sum under `aggregation` (module doc)."""
  if aggregation == "seq_mean":
    return mask / jnp.maximum(seq_sum(mask, seq_ids), 1.0)
  return mask
