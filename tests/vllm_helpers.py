"""What the vLLM engine tests share: the tiny model's shape, the sampler, requests and
the trainer's log-probs to hold an engine's behaviour log-probs against."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from knittrans_jax.rl import token_logprobs
from knittrans_jax.rollout.engine import GroupRequest, response_seeds
from knittrans_jax.rollout.sampler import SamplerConfig, _top_p_filter

SAMPLER = SamplerConfig(max_new_tokens=10, temperature=1.0, stop_tokens=(1,))
SHAPE = dict(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, intermediate_size=96, tie_word_embeddings=True)


def requests(first_gid, groups=3, n=4, seed=0):
  rng = np.random.default_rng(first_gid)
  return [GroupRequest(g, "x", rng.integers(2, 64, int(rng.integers(3, 7))).astype(np.int32), n,
                       response_seeds(seed, g, n)) for g in range(first_gid, first_gid + groups)]


def trainer_logprobs(graphdef, params, prompt, tokens, sampler, length=24):
  """The trainer's forward on prompt + response: log-probs of each response token under
  logits / T, restricted to the top-p nucleus as the sampler draws from it. Padded on
  the right to one length (causal: the padding changes no earlier logit), so the
  forward compiles once."""
  model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
  seq = np.zeros((1, length), np.int32)
  seq[0, :prompt.size + tokens.size] = np.concatenate([prompt, tokens])
  logits = model(jnp.asarray(seq), jnp.ones(seq.shape, bool))[0] / sampler.temperature
  span = slice(prompt.size, prompt.size + tokens.size)
  if sampler.top_p == 1.0:  # exactly the loss's function (rl/losses.py)
    return np.asarray(token_logprobs(logits[None], jnp.asarray(seq))[0])[0, span]
  filtered = _top_p_filter(logits[:-1], sampler.top_p)
  picked = jnp.take_along_axis(jax.nn.log_softmax(filtered, -1), jnp.asarray(seq[0, 1:])[:, None], -1)
  return np.asarray(picked[:, 0])[prompt.size - 1:prompt.size - 1 + tokens.size]
