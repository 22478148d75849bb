"""The policy objective (LossConfig) summed over tokens, with a true global normaliser.

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
from knittrans_jax.rl import objectives
from knittrans_jax.rl.advantages import ESTIMATORS

CORRECTIONS = ("none", *objectives.TOKEN_CORRECTIONS, *objectives.SEQUENCE_CORRECTIONS)
POLICY_LOSSES = objectives.POLICY_LOSSES
AGGREGATIONS = ("token_mean", "seq_mean", "constant")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The objective: an advantage estimator, a policy loss and its aggregation.

  advantage (rl/advantages.py): 'grpo' (group-normalised, the default), 'dr_grpo'
  (no std), 'rloo' (leave-one-out) or 'reinforce_pp' (group mean, batch-normalised).
  policy_loss (rl/objectives.py): 'ppo' (the clipped surrogate; clip-higher with
  clip_high > clip_low, as in DAPO), 'gspo' (the sequence's length-normalised ratio,
  clipped per sequence: clip_low/high are then GSPO's small ranges, e.g. 3e-4 and
  4e-4) or 'cispo' (the policy gradient weighted by the stopped, clipped IS ratio:
  every token keeps its gradient) or 'decoupled_ppo' (AReaL's: the clip against the
  proximal policy, the behaviour ratio as a weight capped at is_high; no extra
  forward here, rl/objectives.py says why). aggregation: 'token_mean' (over the mini-batch's
  loss tokens, the default), 'seq_mean' (each sequence's token mean, averaged over
  sequences) or 'constant' (Dr. GRPO: the token sum over sequences x norm_len).
  kl_coef > 0 adds the k3 estimator of KL(policy || reference) per token.

  behaviour_correction: what to do with tokens whose ratio r = pi/mu (trainer policy
  over the rollout engine's behaviour log-prob) is far from 1, which an engine's
  numerics and the staleness both cause (off by default; rl/objectives.py):
    'none'          the policy loss as is;
    'truncate'      token TIS: each token's term scaled by sg(min(1, is_high / r));
    'mask'/'icepop' tokens with r outside [is_low, is_high] get no gradient (the term
                    is 0; they still count in the normaliser);
    'seq_truncate'  sequence TIS, on the sequence's ratio (the product of its r);
    'seq_mask'      masked IS (MIS): a sequence whose ratio is outside the band is out;
    'geo_reject'    the same on the ratio's geometric mean over the sequence.
  None touches the KL penalty.
  """
  clip_low: float = 0.2
  clip_high: float = 0.2
  kl_coef: float = 0.0
  advantage: str = "grpo"
  policy_loss: str = "ppo"
  aggregation: str = "token_mean"
  # aggregation 'constant': Dr. GRPO's length constant in tokens (0: the job's set-up
  # takes the run's longest response)
  norm_len: int = 0
  # DAPO's overlong shaping (rl/advantages.overlong_penalty): rewards of responses
  # longer than the longest response less this many tokens are lowered; 0: off.
  overlong_buffer: int = 0
  temperature: float = 1.0  # must equal the sampler's: log-probs of logits / temperature
  # Tokens per chunk of the chunked log-probs (a model that returns `Hidden`): one
  # chunk's [B, chunk, vocab] logits exist at a time, forward and backward.
  logprob_chunk: int = 256
  behaviour_correction: str = "none"
  is_low: float = 0.5
  is_high: float = 2.0

  def __post_init__(self):
    for field, value, allowed in (("advantage", self.advantage, ESTIMATORS),
                                  ("policy_loss", self.policy_loss, POLICY_LOSSES),
                                  ("aggregation", self.aggregation, AGGREGATIONS),
                                  ("behaviour_correction", self.behaviour_correction,
                                   CORRECTIONS)):
      if value not in allowed:
        raise ValueError(f"LossConfig.{field} = {value!r}: use one of {allowed}")
    if not isinstance(self.logprob_chunk, int) or self.logprob_chunk <= 0:
      raise ValueError(f"LossConfig.logprob_chunk = {self.logprob_chunk!r} must be a positive int")
    if not 0 < self.is_low <= 1 <= self.is_high:
      raise ValueError(f"LossConfig: is_low {self.is_low} and is_high {self.is_high} must "
                       "satisfy 0 < is_low <= 1 <= is_high")
    if not (0 <= self.clip_low <= 1 and self.clip_high >= 0):
      raise ValueError(f"LossConfig: clip_low {self.clip_low} in [0, 1] and clip_high "
                       f"{self.clip_high} >= 0 are required")
    if self.norm_len < 0:
      raise ValueError(f"LossConfig.norm_len = {self.norm_len}: must be >= 0 (0: the run's "
                       "longest response, set by the job's set-up)")
    if self.overlong_buffer < 0:
      raise ValueError(f"LossConfig.overlong_buffer = {self.overlong_buffer}: must be >= 0")
    if self.policy_loss == "decoupled_ppo" and self.behaviour_correction != "none":
      raise ValueError(f"LossConfig.policy_loss = 'decoupled_ppo' with behaviour_correction = "
                       f"{self.behaviour_correction!r}: decoupled PPO weighs the behaviour ratio "
                       "itself (capped at is_high); a second correction would apply it twice")
    if self.policy_loss == "gspo" and self.behaviour_correction in objectives.TOKEN_CORRECTIONS:
      raise ValueError(f"LossConfig.policy_loss = 'gspo' with behaviour_correction = "
                       f"{self.behaviour_correction!r}: GSPO clips a sequence-level ratio; a "
                       "token-level band or truncation would cut inside its sequences (use a "
                       "sequence-level one: 'seq_truncate', 'seq_mask', 'geo_reject')")

  def normaliser(self, tokens: int, sequences: int) -> float:
    """What a mini-batch's loss sum is divided by (`aggregation`): its loss tokens,
    its sequences (each already its token mean), or sequences x norm_len."""
    if self.aggregation == "token_mean":
      return float(max(tokens, 1))
    if self.aggregation == "seq_mean":
      return float(max(sequences, 1))
    if self.norm_len <= 0:
      raise ValueError("LossConfig.aggregation = 'constant' needs LossConfig.norm_len > 0 "
                       "(Dr. GRPO's length constant; the job sets the longest response)")
    return float(max(sequences, 1) * self.norm_len)


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
                    config: LossConfig, ref_logp: jax.Array | None = None,
                    mask: jax.Array | None = None, seq_ids: jax.Array | None = None):
  """Per-token loss terms (to be summed under the aggregation's weights), each token's
  ratio, the clip indicator and the corrected indicator (behaviour_correction; None
  without one), for `config.policy_loss` (rl/objectives.py).
  `advantages`: per row [B], or per token [B, T] (a packed batch); `mask` and
  `seq_ids` (sequence_ids) are needed by the sequence-level loss (GSPO)."""
  adv = advantages if advantages.ndim == 2 else advantages[:, None]
  adv = jnp.broadcast_to(adv, logp.shape)
  if mask is None:
    mask = jnp.ones_like(logp)
  if seq_ids is None:
    seq_ids = jnp.broadcast_to(jnp.arange(logp.shape[0])[:, None], logp.shape)
  loss, ratio, was_clipped = objectives.policy_terms(
      config.policy_loss, logp, behaviour_logp, adv, mask, seq_ids, config.clip_low,
      config.clip_high, config.is_high)
  # The corrections weigh the policy term only, not the KL penalty below; a masked
  # term is 0 (not 0 x a term that could be inf).
  corrected = None  # (no correction: nothing traced for one)
  if config.behaviour_correction != "none":
    weight, corrected = objectives.correction_weights(
        config.behaviour_correction, logp - behaviour_logp, mask, seq_ids, config.is_low,
        config.is_high)
    loss = jnp.where(weight > 0, loss * weight, 0.0)
  if config.kl_coef and ref_logp is not None:
    d = ref_logp - logp
    loss = loss + config.kl_coef * (jnp.exp(d) - d - 1.0)
  return loss, ratio, was_clipped, corrected


def merge_sums(a: dict, b: dict) -> dict:
  """Two micro-batches' metric sums: added, except 'max_*' entries (maxima)."""
  return {k: jnp.maximum(a[k], b[k]) if k.startswith("max_") else a[k] + b[k] for k in a}


def ppo_loss_sum(outputs, batch: dict, config: LossConfig, version=None):
  """Sum over masked tokens of the PPO loss, plus metric sums (all unnormalised).
  `outputs`: the model's logits, or its `Hidden` states (chunked log-probs).

  Returning sums lets micro-batches and consumers be added up and divided once by
  the mini-batch's normaliser (LossConfig.normaliser: by default its total token
  count, a true global token mean; `merge_sums`).

  With `version` (the parameters' policy version) and the batch's per-row
  `version_first`/`version_last`, the sums also measure the engine against the
  trainer on the tokens at version lag 0 (rows generated wholly by these parameters):
  |logp - behaviour_logp| summed and its maximum. At top_p < 1 that difference also
  holds the log of the nucleus's mass (the behaviour distribution is truncated).
  """
  logp, entropy = logprobs_of(outputs, batch["tokens"], config)
  mask = batch["loss_mask"].astype(logp.dtype)
  seq_ids = objectives.sequence_ids(mask, batch.get("segment_ids"))
  loss, ratio, clipped, corrected = ppo_token_terms(
      logp, batch["behaviour_logp"], batch["advantages"], config, batch.get("ref_logp"), mask,
      seq_ids)
  weights = objectives.token_weights(config.aggregation, mask, seq_ids)
  sums = {
      "loss": jnp.sum(loss * weights),
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
  if config.behaviour_correction != "none":  # tokens truncated, masked or rejected
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
