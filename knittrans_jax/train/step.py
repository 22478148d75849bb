"""Sharded, jitted step functions: per-micro-batch gradients accumulated, then the update.

    fns = StepFunctions(graphdef, shardings, tx, LossConfig(), mesh, rules)
    acc, sums = fns.zero_grads(state.params), fns.zero_sums(batch_like)
    for micro in micro_batches:                # arrive one at a time from the data path
      acc, sums = fns.micro_step(state, acc, sums, micro, total_tokens)
    state, metrics = fns.apply_step(state, acc)

With LossConfig.kl_coef > 0 every call also takes `ref`, the frozen parameters of the
reference policy (sharded like the policy's): each micro-batch's reference log-probs
are computed from them in the same program (a forward pass, no gradient) and feed
the KL term, so the reference costs one forward per micro-batch and one copy of the
parameters, nothing on the host.

`total_tokens` is the number of loss tokens in the whole mini-batch, over every
micro-batch and consumer, so the accumulated gradient is that of a true global
token mean. Gradient and metric sums stay on the devices (both donated to the next
micro-batch): nothing comes back to the host inside a mini-batch.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from knittrans_jax.mesh import activation_sharding, replicated
from knittrans_jax.models.layers import wide
from knittrans_jax.rl.losses import LossConfig, logprobs_of, merge_sums, nll_loss_sum, ppo_loss_sum
from knittrans_jax.train.batch import batch_shardings
from knittrans_jax.train.state import TrainState


def text_forward(model, batch):
  """The decoder's final hidden states and head (the loss projects them in chunks).
  A packed batch brings its segments and their positions."""
  return model(batch["tokens"], batch["attention_mask"], positions=batch.get("positions"),
               segment_ids=batch.get("segment_ids"), hidden=True)


class StepFunctions:

  def __init__(self, graphdef, shardings: TrainState, tx: optax.GradientTransformation,
               loss: LossConfig, mesh: Mesh, rules,
               forward: Callable = text_forward, objective: str = "ppo"):
    if objective not in ("ppo", "nll"):
      raise ValueError(f"objective = {objective!r}: use 'ppo' or 'nll'")
    # The KL term needs reference log-probs: every step call must then pass `ref`.
    self.needs_reference = objective == "ppo" and loss.kl_coef > 0
    self.graphdef, self.shardings, self.tx, self.loss = graphdef, shardings, tx, loss
    self.mesh, self.rules, self.forward, self.objective = mesh, rules, forward, objective
    self._jitted = {}
    self._sum_shapes = {}  # batch shapes -> the metric sums' shapes
    repl = replicated(mesh)
    self._grad_sh = shardings.params
    self.apply_step = jax.jit(self._apply, in_shardings=(shardings, self._grad_sh),
                              out_shardings=(shardings, repl), donate_argnums=0)
    self.zero_grads = jax.jit(  # fp32 accumulator shaped and sharded like the params
        lambda params: jax.tree.map(lambda x: jnp.zeros(x.shape, wide(x.dtype)), params),
        in_shardings=(self._grad_sh,), out_shardings=self._grad_sh)
    self.add_sums = jax.jit(merge_sums, out_shardings=repl,
                            donate_argnums=0)

  # -- pieces ---------------------------------------------------------------
  def objective_sum(self, logits, batch, version=None):
    """(loss summed over the batch's loss tokens, metric sums); `version`: the
    parameters' policy version (the engine-vs-trainer sums, rl/losses.py)."""
    if self.objective == "nll":
      return nll_loss_sum(logits, batch, self.loss.logprob_chunk)
    return ppo_loss_sum(logits, batch, self.loss, version)

  def _check_ref(self, ref) -> None:
    if self.needs_reference and ref is None:
      raise ValueError(f"LossConfig.kl_coef = {self.loss.kl_coef} needs a reference policy: pass "
                       "`ref` (the frozen reference parameters; the job keeps the initial ones) "
                       "or set kl_coef = 0")
    if ref is not None and not self.needs_reference:
      raise ValueError("a reference policy was given, but LossConfig.kl_coef = 0 does not use it")

  def reference_logp(self, ref, batch):
    """The reference policy's per-token log-probs of `batch` [B, T] (no gradient)."""
    out = self.forward(nnx.merge(self.graphdef, jax.lax.stop_gradient(ref)), batch)
    return jax.lax.stop_gradient(logprobs_of(out, batch["tokens"], self.loss)[0])

  def _micro(self, params, batch, total_tokens, version=None, ref=None):
    # Traced under the layout's activation rules: the model's `constrain` calls apply.
    with activation_sharding(self.mesh, self.rules):
      return self._micro_traced(params, batch, total_tokens, version, ref)

  def _micro_traced(self, params, batch, total_tokens, version, ref):
    if ref is not None:
      batch = {**batch, "ref_logp": self.reference_logp(ref, batch)}

    def loss_fn(p):
      loss_sum, sums = self.objective_sum(self.forward(nnx.merge(self.graphdef, p), batch), batch,
                                          version)
      return loss_sum / total_tokens, sums
    (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(lambda g: g.astype(wide(g.dtype)), grads), sums

  def _apply(self, state: TrainState, grads):
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"grad_norm": optax.tree.norm(grads)}
    return TrainState(params, opt_state, state.version + 1), metrics

  # -- jitted entry points (compiled per batch shape) -------------------------
  def zero_sums(self, state: TrainState, batch: dict, ref=None):
    """Device zeros shaped like one micro-batch's metric sums."""
    key = (tuple(sorted((k, v.shape) for k, v in batch.items())), ref is not None)
    if key not in self._sum_shapes:
      self._sum_shapes[key] = jax.eval_shape(
          lambda st, b, r: self._micro(st.params, b, jnp.float32(1), st.version, r)[1],
          state, batch, ref)
    repl = replicated(self.mesh)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=repl), self._sum_shapes[key])

  def micro_step(self, state: TrainState, acc, sums, batch: dict, total_tokens, ref=None):
    """Adds one micro-batch's gradients into `acc` and its metric sums into `sums`
    (both donated, both stay on the devices). `ref`: the reference parameters, when
    the loss has a KL term."""
    self._check_ref(ref)
    if ref is None:
      return self.micro_jit(batch)(state, acc, sums, batch, total_tokens)
    return self.micro_jit(batch, reference=True)(state, acc, sums, batch, total_tokens, ref)

  def micro_jit(self, batch: dict, reference: bool = False):
    """The jitted micro step for `batch`'s shapes (arrays or ShapeDtypeStructs); its
    `.lower(...)` compiles ahead of time (scripts/plan_layout.py). With `reference`
    it takes the reference parameters as a last argument."""
    key = ("micro", tuple(sorted((k, v.shape) for k, v in batch.items())), reference)
    if key not in self._jitted:
      repl = replicated(self.mesh)

      def micro(st, acc, sums, b, n, ref=None):
        grads, s = self._micro(st.params, b, n, st.version, ref)
        return jax.tree.map(jnp.add, acc, grads), merge_sums(sums, s)
      shardings = (self.shardings, self._grad_sh, repl,
                   batch_shardings(self.mesh, self.rules, batch), repl)
      self._jitted[key] = jax.jit(
          micro, in_shardings=shardings + ((self._grad_sh,) if reference else ()),
          out_shardings=(self._grad_sh, repl), donate_argnums=(1, 2))
    return self._jitted[key]
