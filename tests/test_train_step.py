"""Sharded step functions on 8 CPU devices: layouts agree, accumulation is exact,
checkpoints resume bit-identically, a supervised run learns, bad batches are named."""
import jax
import numpy as np
import pytest
from train_helpers import CFG, build, micro_grads, random_batch, to_numpy

from knittrans_jax.train import BadBatchError, Checkpointer, CheckpointConfig, abstract_state, check_batch


def _max_rel(a, b):
  errs = jax.tree.map(lambda x, y: float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)), a, b)
  return max(jax.tree.leaves(errs))


def test_layouts_give_the_same_loss_and_gradients():
  assert len(jax.devices()) == 8
  batch = random_batch(np.random.default_rng(0))
  out = {}
  for layout in ("dp", "fsdp", "fsdp_tp"):
    fns, state = build(layout)
    grads, sums = micro_grads(fns, state, batch, 200.0)
    out[layout] = (to_numpy(sums), to_numpy(grads))
    if layout == "fsdp_tp":  # really sharded: embedding split over both axes
      spec = state.params["embed"]["embedding"][...].sharding.spec
      assert spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  for layout in ("fsdp", "fsdp_tp"):
    np.testing.assert_allclose(out[layout][0]["loss"], out["dp"][0]["loss"], rtol=1e-5)
    assert _max_rel(out[layout][1], out["dp"][1]) < 1e-4


@pytest.fixture(scope="module")
def dp():
  return build("dp")


def test_accumulation_equals_concatenation(dp):
  fns, state = dp
  rng = np.random.default_rng(1)
  micros = [random_batch(rng, B=8) for _ in range(3)]
  total = sum(float(m["loss_mask"].sum()) for m in micros)
  whole = {k: np.concatenate([m[k] for m in micros]) for k in micros[0]}
  g_whole, s_whole = micro_grads(fns, state, whole, total)
  acc, sums = micro_grads(fns, state, micros, total)
  assert _max_rel(to_numpy(acc), to_numpy(g_whole)) < 1e-5
  assert float(sums["tokens"]) == float(s_whole["tokens"]) == total
  new, _ = fns.apply_step(jax.tree.map(lambda x: x.copy(), state), acc)
  assert int(new.version) == int(state.version) + 1


def _train(fns, state, batches):
  for b in batches:
    total = float(b["loss_mask"].sum())
    state, _ = fns.apply_step(state, micro_grads(fns, state, b, total)[0])
  return state


def test_save_restore_continue_is_bit_identical(tmp_path):
  fns, state = build("fsdp")
  rng = np.random.default_rng(2)
  batches = [random_batch(rng) for _ in range(4)]
  ckpt = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(every_steps=2, keep=2))
  state = _train(fns, state, batches[:2])
  assert ckpt.save(state, {"consumed": ["u/0", "u/1"]})
  target = abstract_state(state, fns.shardings)
  straight = _train(fns, state, batches[2:])
  ckpt.wait()
  restored, progress = ckpt.restore(target)
  assert progress == {"consumed": ["u/0", "u/1"]} and int(restored.version) == 2
  assert (restored.params["embed"]["embedding"][...].sharding
          == state.params["embed"]["embedding"][...].sharding)
  resumed = _train(fns, restored, batches[2:])
  for a, b in zip(jax.tree.leaves(to_numpy(straight)), jax.tree.leaves(to_numpy(resumed))):
    np.testing.assert_array_equal(a, b)
  assert ckpt.latest_step() == 2
  ckpt.close()


def test_a_checkpoint_of_an_older_train_state_is_refused_by_name(tmp_path, dp):
  """A checkpoint written while TrainState still had its unused `rng` field names the
  extra field instead of failing inside Orbax."""
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  fns, state = dp
  old = {**state._asdict(), "rng": jnp.zeros((2,), jnp.uint32)}
  with ocp.CheckpointManager(str(tmp_path / "ckpt"), item_names=("state", "progress")) as m:
    m.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(old),
                                      progress=ocp.args.JsonSave({})))
    m.wait_until_finished()
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  with pytest.raises(ValueError, match=r"holds train-state field\(s\) \['rng'\] that TrainState"):
    ckpt.restore(abstract_state(state, fns.shardings))
  ckpt.close()


def test_supervised_sanity_run_drives_the_loss_down():
  fns, state = build("dp", objective="nll", lr=3e-3)
  rng = np.random.default_rng(3)
  # A learnable pattern: token t+1 = (token t + 1) mod vocab.
  B, T = 16, 24
  start = rng.integers(0, CFG.vocab_size, (B, 1))
  tokens = ((start + np.arange(T)[None]) % CFG.vocab_size).astype(np.int32)
  batch = dict(tokens=tokens, attention_mask=np.ones((B, T), bool),
               loss_mask=np.ones((B, T), np.float32), behaviour_logp=np.zeros((B, T), np.float32),
               advantages=np.zeros(B, np.float32))
  losses = []
  for _ in range(30):
    grads, sums = micro_grads(fns, state, batch, float(B * T))
    losses.append(float(sums["loss"]) / float(sums["tokens"]))
    state, _ = fns.apply_step(state, grads)
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("change,message", [
    (lambda b: b.update(tokens=b["tokens"][:, :-1]), r"batch\['attention_mask'\] has shape"),
    (lambda b: b.update(tokens=b["tokens"].astype(np.float32)), r"batch\['tokens'\] has dtype float32"),
    (lambda b: b["tokens"].__setitem__((0, 0), 64), r"ids in \[0, 64\], outside the vocabulary \[0, 64\)"),
    (lambda b: b["tokens"].__setitem__((0, 0), -1), "outside the vocabulary"),
    (lambda b: b.pop("advantages"), "missing"),
    (lambda b: b["advantages"].__setitem__(0, np.nan), "NaN"),
    (lambda b: b.update(advantages=b["advantages"][:, None]), "expected rank 1"),
])
def test_bad_batches_are_named(change, message):
  batch = random_batch(np.random.default_rng(4))
  change(batch)
  with pytest.raises(BadBatchError, match=message):
    check_batch(batch, CFG.vocab_size, rows_multiple=8)


def test_rows_must_split_over_shards():
  with pytest.raises(BadBatchError, match="12 rows does not split over 8"):
    check_batch(random_batch(np.random.default_rng(5), B=12), CFG.vocab_size, rows_multiple=8)


def test_kl_against_a_reference_policy_by_hand():
  """With kl_coef > 0 the step computes the reference's log-probs from `ref` itself
  and adds kl_coef x k3 per token: the metric, the loss and the gradient equal the
  same objective composed by hand from full logits with the reference log-probs
  given; without a reference it is an error, not a silently dropped term."""
  import jax.numpy as jnp
  from flax import nnx

  from knittrans_jax.rl import LossConfig, ppo_loss_sum, token_logprobs
  cfg = LossConfig(kl_coef=0.3)
  fns, state = build("dp", loss=cfg)
  rng = np.random.default_rng(3)
  batch = random_batch(rng, B=8)
  total = float(batch["loss_mask"].sum())
  # A reference that differs from the policy.
  ref = jax.tree.map(lambda x: x + 0.05 * jnp.asarray(rng.normal(size=x.shape), x.dtype),
                     state.params)
  acc, sums = fns.micro_step(state, fns.zero_grads(state.params),
                             fns.zero_sums(state, batch, ref), batch, total, ref)

  @jax.jit  # the hand computation compiled once, not run op by op
  def logp(params):
    logits = nnx.merge(fns.graphdef, params)(jnp.asarray(batch["tokens"]),
                                             jnp.asarray(batch["attention_mask"]))
    return logits, token_logprobs(logits, jnp.asarray(batch["tokens"]))[0]

  _, ref_logp = logp(ref)
  _, pol_logp = logp(state.params)
  d = ref_logp - pol_logp
  k3 = float(jnp.sum((jnp.exp(d) - d - 1.0) * batch["loss_mask"]))
  assert k3 > 0 and float(sums["kl"]) == pytest.approx(k3, rel=1e-4)
  hand = {**{k: jnp.asarray(v) for k, v in batch.items()}, "ref_logp": ref_logp}

  def objective(params):
    return ppo_loss_sum(logp(params)[0], hand, cfg)[0] / total

  want = jax.jit(jax.grad(objective))(state.params)
  assert _max_rel(to_numpy(acc), to_numpy(want)) < 1e-4
  no_kl, _ = build("dp")
  _, base = no_kl.micro_step(state, no_kl.zero_grads(state.params), no_kl.zero_sums(state, batch),
                             batch, total)
  assert float(sums["loss"]) - float(base["loss"]) == pytest.approx(0.3 * k3, rel=1e-3)
  with pytest.raises(ValueError, match="kl_coef = 0.3 needs a reference policy"):
    fns.micro_step(state, fns.zero_grads(state.params), fns.zero_sums(state, batch), batch, total)
  with pytest.raises(ValueError, match="kl_coef = 0 does not use it"):
    no_kl.micro_step(state, no_kl.zero_grads(state.params), no_kl.zero_sums(state, batch), batch,
                     total, ref)


def test_activations_are_constrained_by_the_layouts_logical_rules():
  """The mesh file's activation rules reach the compiled step: under fsdp_tp the
  attention heads, the MLP's hidden units and the logits' vocabulary are split over
  'tensor' and every block's output over 'fsdp' by batch; the model called outside
  a train step is not constrained at all."""
  import re

  import jax.numpy as jnp
  from flax import nnx
  fns, state = build("fsdp_tp")
  batch = random_batch(np.random.default_rng(0), B=8)
  text = fns.micro_jit(batch).lower(state, fns.zero_grads(state.params), fns.zero_sums(state, batch),
                                    batch, jnp.float32(1)).as_text()
  found = re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, (\[.*?\])> : tensor<([0-9x]+)x", text)
  specs = {(spec, shape) for spec, shape in found}
  # CFG: 4 heads of 8, MLP 64 wide, width 32, vocabulary 64; 24 tokens, 23 predicted.
  assert ('[{"fsdp"}, {}, {"tensor"}, {}]', "8x24x4x8") in specs  # q, k, v
  assert ('[{"fsdp"}, {}, {"tensor"}]', "8x24x64") in specs  # the MLP's hidden units
  assert ('[{"fsdp"}, {}, {"tensor"}]', "8x23x64") in specs  # a chunk of logits
  assert ('[{"fsdp"}, {}, {}]', "8x24x32") in specs  # a block's output (the residual stream)
  model = nnx.merge(fns.graphdef, state.params)
  plain = jax.jit(lambda t, m: model(t, m)).lower(jnp.asarray(batch["tokens"]),
                                                  jnp.asarray(batch["attention_mask"])).as_text()
  assert "sharding_constraint" not in plain


def test_masked_tokens_get_no_gradient(dp):
  """Tokens with loss mask 0 inside a response (a tool's output, rollout/tasks.py's
  'lookup') are context only: whatever their behaviour log-probs say, the gradient is
  the same to the bit, and the same perturbation on a trained token changes it."""
  fns, state = dp
  batch = random_batch(np.random.default_rng(5), B=8)
  inside = np.zeros_like(batch["loss_mask"], bool)
  inside[:, 8:10] = batch["attention_mask"][:, 8:10]  # two tokens mid-response, masked
  batch["loss_mask"] = np.where(inside, 0, batch["loss_mask"]).astype(np.float32)
  total = float(batch["loss_mask"].sum())
  g0, s0 = micro_grads(fns, state, batch, total)
  moved = dict(batch, behaviour_logp=np.where(inside, -40.0, batch["behaviour_logp"]).astype(
      np.float32))
  g1, s1 = micro_grads(fns, state, moved, total)
  for a, b in zip(jax.tree.leaves(to_numpy(g0)), jax.tree.leaves(to_numpy(g1))):
    np.testing.assert_array_equal(a, b)
  assert float(s0["tokens"]) == float(s1["tokens"]) == total
  trained = (batch["loss_mask"] > 0) & ~inside
  trained[:, :11] = False  # one trained token per row after the masked ones
  first = trained.argmax(axis=1)
  hit = np.zeros_like(trained)
  hit[np.arange(len(first)), first] = trained[np.arange(len(first)), first]
  control = dict(batch, behaviour_logp=np.where(hit, -40.0, batch["behaviour_logp"]).astype(
      np.float32))
  g2, _ = micro_grads(fns, state, control, total)
  assert _max_rel(to_numpy(g2), to_numpy(g0)) > 1e-3


def test_the_cosine_schedule_runs_to_the_jobs_last_step():
  """OptimizerConfig.total_steps 0 is derived by the job (train_batches x M): the
  cosine reaches 10% of the peak at the run's last step, not at a restated count."""
  from knittrans_jax.train.optimizer import OptimizerConfig, learning_rate
  cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=2, schedule="cosine")
  with pytest.raises(ValueError, match="'cosine' needs total_steps"):
    learning_rate(cfg)
  lr = learning_rate(cfg.for_steps(12))
  assert float(lr(2)) == pytest.approx(1.0) and float(lr(12)) == pytest.approx(0.1)
  assert cfg.for_steps(12).total_steps == 12
  assert OptimizerConfig(total_steps=50).for_steps(12).total_steps == 50  # given: kept


def test_checkpoint_config_rejects_a_zero_interval():
  """orbax divides by the interval: 0 fails at set-up, naming the field, not mid-run."""
  with pytest.raises(ValueError, match=r"CheckpointConfig.every_steps = 0"):
    CheckpointConfig(every_steps=0)
  with pytest.raises(ValueError, match=r"CheckpointConfig.keep = 0"):
    CheckpointConfig(keep=0)
