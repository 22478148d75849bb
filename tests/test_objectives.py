"""The objectives (rl/objectives.py, rl/advantages.py) against naive numpy references
on random inputs: values and gradients in float32, packed equal to padded, and the
configurations that cannot work refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from knittrans_jax.rl import LossConfig
from knittrans_jax.rl.advantages import advantages, advantages_by_id
from knittrans_jax.rl.losses import ppo_token_terms
from knittrans_jax.rl.objectives import sequence_ids, token_weights
from knittrans_jax.types import GroupInfo, TrajMeta

B, T = 4, 9


def random_batch(seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, T, B)
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  mask[:, 0] = 0  # position 0 is never a loss token
  logp = rng.normal(-2.0, 0.5, (B, T)).astype(np.float32)
  behaviour = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)
  adv = rng.normal(0, 1, B).astype(np.float32)
  return logp, behaviour, adv, mask


def reference(kind, logp, behaviour, adv, mask, lo, hi, aggregation="token_mean"):
  """(loss sum, d loss sum / d logp) token by token, in numpy."""
  loss, grad = np.zeros_like(logp), np.zeros_like(logp)
  for b in range(B):
    toks = [t for t in range(T) if mask[b, t]]
    seq_r = np.exp(np.mean([logp[b, t] - behaviour[b, t] for t in toks]))
    for t in toks:
      r, a = np.exp(logp[b, t] - behaviour[b, t]), adv[b]
      if kind == "ppo" or kind == "gspo":
        x = r if kind == "ppo" else seq_r
        un, cl = x * a, np.clip(x, 1 - lo, 1 + hi) * a
        loss[b, t] = -min(un, cl)
        grad[b, t] = -x * a if un <= cl else 0.0
      elif kind == "cispo":
        w = np.clip(r, 1 - lo, 1 + hi)
        loss[b, t], grad[b, t] = -w * a * logp[b, t], -w * a
      else:  # decoupled_ppo: the proximal ratio is 1; the behaviour weight capped at 2
        w = min(r, 2.0)
        loss[b, t], grad[b, t] = -w * a, -w * a
    if aggregation == "seq_mean":
      loss[b] /= len(toks)
      grad[b] /= len(toks)
  return loss.sum(), grad


@pytest.mark.parametrize("kind,lo,hi", [("ppo", 0.2, 0.28), ("gspo", 3e-2, 4e-2),
                                        ("cispo", 1.0, 0.3), ("decoupled_ppo", 0.2, 0.2)])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_policy_losses_match_the_numpy_reference(kind, lo, hi, aggregation):
  logp, behaviour, adv, mask = random_batch()
  cfg = LossConfig(policy_loss=kind, clip_low=lo, clip_high=hi, aggregation=aggregation)
  m, ids = jnp.asarray(mask), sequence_ids(jnp.asarray(mask))

  def total(lp):
    loss, _, _, _ = ppo_token_terms(lp, jnp.asarray(behaviour), jnp.asarray(adv), cfg, None, m, ids)
    return jnp.sum(loss * token_weights(aggregation, m, ids))

  value, grad = jax.value_and_grad(total)(jnp.asarray(logp))
  want, want_grad = reference(kind, logp, behaviour, adv, mask, lo, hi, aggregation)
  np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)
  assert np.abs(want_grad).sum() > 0  # the case exercises a gradient


@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo", "decoupled_ppo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_packed_equals_padded(kind, aggregation):
  """The same sequences padded one a row, or packed back to back in one row with
  segment ids and per-token advantages: the same loss sum and per-token gradients."""
  logp, behaviour, adv, mask = random_batch(1)
  cfg = LossConfig(policy_loss=kind, clip_low=0.05, clip_high=0.08, aggregation=aggregation)
  m, ids = jnp.asarray(mask), sequence_ids(jnp.asarray(mask))
  rows = [np.flatnonzero(mask[b]) for b in range(B)]
  L = sum(len(r) for r in rows)
  pk = {k: np.zeros((1, L), np.float32) for k in ("logp", "behaviour", "adv", "mask")}
  seg, pos = np.zeros((1, L), np.int32), 0
  for b, r in enumerate(rows):
    sl = slice(pos, pos + len(r))
    pk["logp"][0, sl], pk["behaviour"][0, sl] = logp[b, r], behaviour[b, r]
    pk["adv"][0, sl], pk["mask"][0, sl], seg[0, sl] = adv[b], 1.0, b + 1
    pos += len(r)

  def total(lp, beh, a, mk, sid):
    loss, _, _, _ = ppo_token_terms(lp, beh, a, cfg, None, mk, sid)
    return jnp.sum(loss * token_weights(aggregation, mk, sid))

  pid = sequence_ids(jnp.asarray(pk["mask"]), jnp.asarray(seg))
  v1, g1 = jax.value_and_grad(total)(jnp.asarray(logp), jnp.asarray(behaviour),
                                     jnp.asarray(adv), m, ids)
  v2, g2 = jax.value_and_grad(total)(jnp.asarray(pk["logp"]), jnp.asarray(pk["behaviour"]),
                                     jnp.asarray(pk["adv"]), jnp.asarray(pk["mask"]), pid)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
  np.testing.assert_allclose(np.concatenate([np.asarray(g1)[b, r] for b, r in enumerate(rows)]),
                             np.asarray(g2)[0], rtol=1e-5, atol=1e-7)


def test_at_lag_zero_every_policy_loss_is_the_policy_gradient():
  """behaviour = current: ratios are 1, nothing is clipped, and every loss's gradient
  is -A per token (the plain policy gradient)."""
  logp, _, adv, mask = random_batch(2)
  m, ids = jnp.asarray(mask), sequence_ids(jnp.asarray(mask))
  for kind in ("ppo", "gspo", "cispo", "decoupled_ppo"):
    cfg = LossConfig(policy_loss=kind, clip_low=1e-3, clip_high=1e-3)

    def total(lp):
      loss, _, clipped, _ = ppo_token_terms(lp, jax.lax.stop_gradient(lp), jnp.asarray(adv), cfg,
                                         None, m, ids)
      return jnp.sum(loss * m), clipped

    grad, clipped = jax.grad(total, has_aux=True)(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(grad), -adv[:, None] * mask, rtol=1e-5, atol=1e-7)
    assert float(jnp.sum(clipped * m)) == 0


def test_advantage_estimators_match_their_definitions():
  rng = np.random.default_rng(3)
  n, G = 4, 5
  r = rng.random(G * n).astype(np.float32)
  g = r.reshape(G, n)
  mean, std = g.mean(1, keepdims=True), g.std(1, keepdims=True)
  loo = np.array([[g[i, j] - np.mean(np.delete(g[i], j)) for j in range(n)] for i in range(G)])
  centred = g - mean
  want = {"grpo": (centred / (std + 1e-6)).ravel(), "dr_grpo": centred.ravel(),
          "rloo": loo.ravel(),
          "reinforce_pp": ((centred - centred.mean()) / (centred.std() + 1e-6)).ravel()}
  for name, w in want.items():
    np.testing.assert_allclose(advantages(r, n, name), w, rtol=1e-5, atol=1e-6)
    # The planner's side, over metadata, gives the same per trajectory.
    metas = [[TrajMeta(unit="u", row=i * n + j, token_start=0, prompt_len=1, response_len=2,
                       source="s", group_id=i, index_in_group=j, version_first=0,
                       version_last=0, reward=float(g[i, j])) for j in range(n)] for i in range(G)]
    by_id = advantages_by_id([GroupInfo.from_metas(ms) for ms in metas], name)
    np.testing.assert_allclose([by_id[m.id] for ms in metas for m in ms], w, rtol=1e-5,
                               atol=1e-6)
  same = np.ones(n, np.float32)  # a group that agrees has no signal
  for name in ("grpo", "dr_grpo", "rloo"):
    assert not np.any(advantages(same, n, name))


@pytest.mark.parametrize("bad,match", [
    (dict(advantage="ppo"), r"LossConfig.advantage = 'ppo'"),
    (dict(policy_loss="dpo"), r"LossConfig.policy_loss = 'dpo'"),
    (dict(aggregation="sum"), r"LossConfig.aggregation = 'sum'"),
    (dict(norm_len=-1), r"LossConfig.norm_len = -1"),
    (dict(overlong_buffer=-4), r"LossConfig.overlong_buffer = -4"),
    (dict(policy_loss="gspo", behaviour_correction="mask"), r"'gspo' with behaviour_correction"),
    (dict(policy_loss="decoupled_ppo", behaviour_correction="truncate"),
     r"'decoupled_ppo' with behaviour_correction = 'truncate'"),
    (dict(behaviour_correction="tis"), r"LossConfig.behaviour_correction = 'tis'"),
    (dict(clip_low=1.5), r"clip_low 1.5"),
])
def test_a_configuration_that_cannot_work_is_refused_by_name(bad, match):
  with pytest.raises(ValueError, match=match):
    LossConfig(**bad)


def test_the_normaliser_follows_the_aggregation():
  assert LossConfig().normaliser(120, 8) == 120
  assert LossConfig(aggregation="seq_mean").normaliser(120, 8) == 8
  assert LossConfig(aggregation="constant", norm_len=32).normaliser(120, 8) == 256
  with pytest.raises(ValueError, match="norm_len > 0"):
    LossConfig(aggregation="constant").normaliser(120, 8)


def test_overlong_penalty_is_dapos_soft_punishment():
  from knittrans_jax.rl.advantages import overlong_penalty
  np.testing.assert_allclose(overlong_penalty([10, 12, 14, 16, 20], 16, 4),
                             [0.0, 0.0, -0.5, -1.0, -1.0])


def test_recipes_reach_the_job_setup_and_planner():
  """Dr. GRPO's constant is the run's longest response, DAPO's overlong shaping and
  zero-signal drop reach the planner and the admission spec (in this process, from
  the recipes' gin files on the agentic workload)."""
  import argparse

  import gin

  from knittrans_jax import cli, gin_cli
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.job.setup import job_setup, make_planner
  cli.register_configurables()

  def setup_of(recipe):
    gin.clear_config()
    gin_cli.parse(argparse.Namespace(gin_file=["configs/agentic_tails.gin",
                                               f"configs/recipes/{recipe}.gin"],
                                     gin_bindings=[]))
    try:
      return job_setup(JobConfig())
    finally:
      gin.clear_config()

  longest = 80 - 4  # AgentConfig.max_tokens less the agentic prompt
  dr = setup_of("dr_grpo")
  assert dr.loss.aggregation == "constant" and dr.loss.norm_len == longest
  dapo = setup_of("dapo")
  trainers = argparse.Namespace(rows_multiple=1, shared_images=False, consumer_host=None)
  planner = make_planner(dapo, 1, trainers, None)
  assert planner.overlong == (longest, 16) and dapo.cfg.spec.drop_zero_signal
  assert dapo.loss.clip_high == 0.28 and setup_of("gspo").loss.policy_loss == "gspo"


@pytest.mark.slow
def test_a_sequence_level_recipe_runs_the_agentic_job(tmp_path):
  """GSPO (a sequence's ratio over packed rows' segments) runs the agentic job end to
  end: every step trains, the loss is finite, the operative config names it."""
  import json
  import math
  import os

  from knittrans_jax.job.metrics import read_metrics
  from test_job import finish, start
  gin_file = tmp_path / "run.gin"
  gin_file.write_text("include 'configs/agentic_test.gin'\n"
                      "include 'configs/recipes/gspo.gin'\n")
  work = tmp_path / "run"
  finish(start(work, "JobConfig.train_batches = 1", "JobConfig.mode = 'colocated'",
               gin_file=str(gin_file)))
  summary = json.load(open(os.path.join(work, "summary.json")))
  recs = read_metrics(str(work))
  assert summary["steps"] == len(recs) == 2 and summary["quota_violations"] == 0
  assert all(math.isfinite(r["loss"]) for r in recs)
  assert "LossConfig.policy_loss = 'gspo'" in open(os.path.join(work, "operative_config.gin")).read()


def reference_weights(kind, logp, behaviour, mask, lo, hi):
  """Each token's correction weight, sequence by sequence, in numpy."""
  w = np.ones_like(logp)
  for b in range(B):
    toks = [t for t in range(T) if mask[b, t]]
    log_r = np.array([logp[b, t] - behaviour[b, t] for t in toks], np.float64)
    for k, t in enumerate(toks):
      r = np.exp(log_r[k])
      x = {"truncate": r, "mask": r, "icepop": r, "seq_truncate": np.exp(log_r.sum()),
           "seq_mask": np.exp(log_r.sum()), "geo_reject": np.exp(log_r.mean())}[kind]
      w[b, t] = min(1.0, hi / x) if "truncate" in kind else float(lo <= x <= hi)
  return w


@pytest.mark.parametrize("kind", ["truncate", "mask", "icepop", "seq_truncate", "seq_mask",
                                  "geo_reject"])
def test_corrections_match_the_reference_and_vanish_at_lag_zero(kind):
  """Each correction's per-token weight against numpy (the PPO surrogate scaled by
  it, gradient included), its corrected count, and at lag 0 (behaviour = current) the
  loss and gradient of 'none' to the bit."""
  logp, behaviour, adv, mask = random_batch(4)
  lo, hi = (0.9, 1.03) if kind == "geo_reject" else (0.8, 1.2)  # bands that bite here
  m, ids = jnp.asarray(mask), sequence_ids(jnp.asarray(mask))
  w = reference_weights(kind, logp, behaviour, mask, lo, hi)
  assert 0 < (w[mask > 0] < 1).sum() < (mask > 0).sum()  # the band bites, not everywhere
  cfg = LossConfig(behaviour_correction=kind, is_low=lo, is_high=hi, clip_low=0.2,
                   clip_high=0.2)
  none = LossConfig(clip_low=0.2, clip_high=0.2)

  def total(lp, beh, c):
    loss, _, _, corrected = ppo_token_terms(lp, beh, jnp.asarray(adv), c, None, m, ids)
    return jnp.sum(loss * m), corrected

  (v, corrected), g = jax.value_and_grad(total, has_aux=True)(
      jnp.asarray(logp), jnp.asarray(behaviour), cfg)
  want, want_grad = reference("ppo", logp, behaviour, adv, mask, 0.2, 0.2)
  per_token = np.zeros_like(logp)
  for b in range(B):  # the reference's per-token loss, weighted
    for t in range(T):
      if mask[b, t]:
        r = np.exp(logp[b, t] - behaviour[b, t])
        per_token[b, t] = -min(r * adv[b], np.clip(r, 0.8, 1.2) * adv[b])
  np.testing.assert_allclose(float(v), (per_token * w).sum(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(g), want_grad * w, rtol=1e-4, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(corrected)[mask > 0] > 0, (w < 1)[mask > 0])
  # Lag 0: the same as no correction.
  lp = jnp.asarray(logp)
  (a, _), ga = jax.value_and_grad(total, has_aux=True)(lp, lp, cfg)
  (b_, _), gb = jax.value_and_grad(total, has_aux=True)(lp, lp, none)
  assert float(a) == float(b_) and np.array_equal(np.asarray(ga), np.asarray(gb))
