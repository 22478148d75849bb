"""A jitted sampler for the NNX decoder with a KV cache.

Prompts are left-padded to a common length P so that every row's next token goes
to the same cache slot; RoPE positions count real tokens only, so padding does not
shift them. `generate` returns one `Sampled` per prompt: the sampled tokens (up to
and including the first stop token), their behaviour log-probs and, with a tool, the
tokens it inserted.

Each row samples with its own key (`rng` may be one key per row), so a response is
a function of its key and the weights alone, not of which other rows share the
call: a group's responses come out the same from a worker's call of 4 groups and
from the colocated reference's call of 16 (rollout/jax_engine.py keys each response
by its integer seed).

Behaviour log-probs are those of the distribution actually sampled: log-softmax of
logits / temperature, restricted to the top-p nucleus and renormalised when
top_p < 1. The trainer's policy is the untruncated one at the same temperature
(rl/losses.py; the job checks the two temperatures agree), so the importance ratio
pi/mu then also corrects for the truncation: on-policy it equals the nucleus's
probability mass at each token (<= 1), not 1.
"""
from __future__ import annotations

import dataclasses
from typing import Any
from functools import partial

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx



@gin.configurable
@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  max_new_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = (1,)
  greedy: bool = False  # argmax decoding (evaluation, parity checks); log-probs at temperature

  def __post_init__(self):
    if self.temperature <= 0 or not 0 < self.top_p <= 1:
      raise ValueError(f"SamplerConfig: temperature {self.temperature} must be > 0 and top_p "
                       f"{self.top_p} in (0, 1]")


@dataclasses.dataclass(frozen=True)
class Sampled:
  """One prompt's response, host arrays: `tokens` int32 [R] (up to and including the
  first stop token), `logprobs` float32 [R] (behaviour log-probs; 0 on inserted
  tokens), `inserted` bool [R] (the tokens a tool inserted; None: no tool was given)."""
  tokens: np.ndarray
  logprobs: np.ndarray
  inserted: np.ndarray | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Decoded:
  """What the jitted decode loop returns, [B, N] per row (lengths [B])."""
  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  inserted: jax.Array


def _top_p_filter(logits, top_p):
  sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  cum = jnp.cumsum(probs, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p (always the top token).
  cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
  cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
  return jnp.where(logits < cutoff, -jnp.inf, logits)


@partial(jax.jit, static_argnames=("graphdef", "config", "banned", "call_token"))
def _generate(graphdef, params, prompts, valid, rng, config: SamplerConfig, images=None,
              image_index=None, mrope=None, banned: tuple[int, ...] = (), tool=None,
              call_token: int = -1):
  model = nnx.merge(graphdef, params)
  B, P = prompts.shape
  N = config.max_new_tokens
  Q = 0
  if mrope is not None:  # Qwen-VL: each unique image through the tower once, in one pack
    embeds = model.encode(mrope["images"].pixel_values, mrope["images"].grid)
    logits, caches = model.prefill(
        prompts, valid, P + N, positions=mrope["positions"], rope_delta=mrope["rope_delta"],
        image_embeds=jnp.take(embeds, mrope["embed_index"], axis=0))  # each pad token's row
  elif images is None:
    logits, caches = model.prefill(prompts, valid, P + N)
  else:  # a VLM: the image embeddings take cache slots 0..Q-1
    Q = model.encoder.config.num_tokens
    logits, caches = model.prefill(prompts, valid, Q + P + N, images, image_index)
  key_valid = jnp.concatenate([jnp.ones((B, Q), bool), valid, jnp.zeros((B, N), bool)], axis=1)
  start = Q + valid.sum(axis=1).astype(jnp.int32)
  P = Q + P  # decode slots follow the prefix and the prompt
  stops = jnp.asarray(config.stop_tokens, jnp.int32).reshape(-1)

  # A while loop, not a scan: decoding stops once every row has stopped, so a call's
  # time follows its longest response (which is what dispatch policies learn).
  def cond(carry):
    t, done = carry[0], carry[4]
    return (t < N) & ~jnp.all(done)

  K = 0 if tool is None else tool.shape[1]

  def body(carry):
    t, logits, caches, key_valid, done, rng, tokens, logps, lives, k, forced = carry
    keys = jax.vmap(jax.random.split)(rng)  # [B, 2]: each row's own stream
    rng, sub = keys[:, 0], keys[:, 1]
    scaled = logits / config.temperature
    if banned:  # never sampled: a response holds no image placeholders
      scaled = scaled.at[:, jnp.asarray(banned)].set(-jnp.inf)
    filtered = _top_p_filter(scaled, config.top_p) if config.top_p < 1.0 else scaled
    if config.greedy:
      token = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
    else:
      token = jax.vmap(jax.random.categorical)(sub, filtered).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), token[:, None], axis=-1)[:, 0]
    if tool is not None:  # a row inside its tool output takes the tool's token, unsampled
      inside = (k >= 0) & (k < K)
      token = jnp.where(inside, jnp.take_along_axis(tool, jnp.clip(k, 0, K - 1)[:, None],
                                                    axis=1)[:, 0], token)
      logp = jnp.where(inside, 0.0, logp)
      forced = forced.at[:, t].set(inside & ~done)
      # One call per response: its output follows the call token, then sampling resumes.
      # A row whose tool output is negative has no tool.
      k = jnp.where(inside, jnp.where(k + 1 == K, -2, k + 1),
                    jnp.where((k == -1) & (token == call_token) & ~done & (tool[:, 0] >= 0),
                              0, k))
    live = ~done
    token = jnp.where(live, token, 0)
    logp = jnp.where(live, logp, 0.0)
    done = done | jnp.isin(token, stops)
    key_valid = key_valid.at[:, P + t].set(live)
    logits, caches = model.decode_step(token, start + t, caches, P + t, key_valid)
    tokens, logps, lives = (tokens.at[:, t].set(token), logps.at[:, t].set(logp),
                            lives.at[:, t].set(live))
    return t + 1, logits, caches, key_valid, done, rng, tokens, logps, lives, k, forced

  init = (jnp.int32(0), logits, caches, key_valid, jnp.zeros((B,), bool), rng,
          jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), jnp.float32), jnp.zeros((B, N), bool),
          jnp.full((B,), -1, jnp.int32), jnp.zeros((B, N), bool))
  out = jax.lax.while_loop(cond, body, init)
  tokens, logps, live, _, forced = out[6:]
  return _Decoded(tokens, logps, live.sum(axis=1), forced)


def left_pad(prompts: list[np.ndarray], pad_id: int = 0,
             length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads to `length` (default: the longest prompt); a fixed length avoids recompiles."""
  P = max(len(p) for p in prompts) if length is None else length
  out = np.full((len(prompts), P), pad_id, np.int32)
  valid = np.zeros((len(prompts), P), bool)
  for i, p in enumerate(prompts):
    out[i, P - len(p):] = p
    valid[i, P - len(p):] = True
  return out, valid


def generate(graphdef, params, prompts: list[np.ndarray], rng: jax.Array,
             config: SamplerConfig, prompt_len: int | None = None,
             images: np.ndarray | None = None, image_index: np.ndarray | None = None,
             image_inputs: Any = None, banned: tuple[int, ...] = (),
             tool_outputs: np.ndarray | None = None, call_token: int | None = None
             ) -> list[Sampled]:
  """Samples one response per prompt: a `Sampled` each (tokens, behaviour log-probs).

  A tool call (multi-turn episodes): with `tool_outputs` [B, K] and `call_token`, the
  first time row i samples `call_token` the K tokens tool_outputs[i] follow it in the
  response and in the context the row goes on from, unsampled (log-prob 0) (a row of
  -1s: that row has no tool); each
  result's `inserted` is then True on the tool's tokens (what the loss mask leaves out).

  `rng`: one key (split into one per row) or one key per prompt. For a VLM, `images`
  [U, H, W, C] are encoded once each and row i sees images[image_index[i]]. With
  `image_inputs` (Qwen-VL's processor of the stored images) `images` are the U stored
  images (any sizes) and row i's prompt holds image_index[i]'s run of image-pad tokens;
  the M-RoPE positions and each row's rope delta come from the host (its `prefill`).
  `banned` token ids are never sampled (their probability is 0 in the behaviour
  log-probs too, like tokens outside the top-p nucleus): the vision special tokens,
  which in a response would read as an image with no pixels."""
  tokens, valid = left_pad(prompts, length=prompt_len)
  extra = {}
  if image_inputs is not None:
    index = np.arange(len(prompts)) if image_index is None else np.asarray(image_index)
    extra = dict(mrope=image_inputs.prefill(tokens, valid, images, index))
  elif images is not None:
    index = np.arange(len(prompts)) if image_index is None else np.asarray(image_index)
    extra = dict(images=jnp.asarray(images), image_index=jnp.asarray(index, jnp.int32))
  if rng.shape == ():
    rng = jax.random.split(rng, len(prompts))
  if rng.shape != (len(prompts),):
    raise ValueError(f"rng: one key or one per prompt ({len(prompts)}), got shape {rng.shape}")
  if tool_outputs is not None:
    tool = np.asarray(tool_outputs)
    if tool.dtype.kind not in "iu" or tool.shape[:1] != (len(prompts),) or tool.ndim != 2:
      raise ValueError(f"tool_outputs: an integer array [{len(prompts)}, K] (one row per "
                       f"prompt), got {tool.dtype} {tool.shape}")
    if call_token is None:
      raise ValueError("tool_outputs without call_token: which token calls the tool?")
    extra.update(tool=jnp.asarray(tool, jnp.int32), call_token=int(call_token))
  out = jax.device_get(
      _generate(graphdef, params, jnp.asarray(tokens), jnp.asarray(valid), rng, config,
                banned=tuple(sorted(set(int(b) for b in banned))), **extra))
  lengths = out.lengths
  return [Sampled(out.tokens[i, :lengths[i]].astype(np.int32),
                  out.logprobs[i, :lengths[i]].astype(np.float32),
                  None if tool_outputs is None else out.inserted[i, :lengths[i]].copy())
          for i in range(len(prompts))]
