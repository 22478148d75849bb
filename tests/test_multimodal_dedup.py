"""Encode-once multimodal step: exactly the naive gradient, one encode and one
encoder backward per unique image per mini-batch, stochastic encoders refused."""
import gin
import jax
import numpy as np
import pytest
from flax import nnx

from knittrans_jax.dataplane import plan_micro_batches
from knittrans_jax.job.batching import build_packed_batch
from knittrans_jax.models import DecoderConfig
from knittrans_jax.models.vit import ViTConfig
from knittrans_jax.models.vlm import VLM
from knittrans_jax.multimodal import (EncodeOnceConfig, EncodeOnceStep, EncoderCalls, ImagePlanError,
                                      StochasticEncoderError, check_deterministic, naive_vlm_forward,
                                      plan_images)
from knittrans_jax.rl import LossConfig
from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, init_train_state,
                                 make_mesh, make_optimizer)
from knittrans_jax.train.batch import check_batch, rows_multiple
from knittrans_jax.train.state import TrainState
from knittrans_jax.types import GroupInfo, MiniBatch, Payload, TrajMeta
from train_helpers import micro_grads

VIT = ViTConfig(image_size=16, patch_size=4, width=32, depth=2, heads=4, mlp_width=64)
LM = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64)
T = 12


def mini_batch(groups: int, n: int, rng) -> MiniBatch:
  out = []
  for g in range(groups):
    length = rng.integers(6, T + 1, n)
    metas = tuple(TrajMeta(unit=f"u{g % 2}", row=g * n + i, token_start=0, prompt_len=3,
                           response_len=int(length[i]) - 3, source="vqa", group_id=g,
                           index_in_group=i, version_first=0, version_last=0, reward=0.0,
                           image_ids=(f"img{g}",)) for i in range(n))
    out.append(GroupInfo(g, "vqa", sum(m.length for m in metas), 0, metas=metas))
  return MiniBatch(0, 0, tuple(out), 0)


def build(layout, calls, dtype="float32", **vit_kw):
  gin.clear_config()
  gin.parse_config_file(f"configs/mesh/{layout}.gin")
  mesh_cfg = MeshConfig()
  gin.clear_config()
  mesh = make_mesh(mesh_cfg)
  tx = make_optimizer(OptimizerConfig())
  vit = ViTConfig(**{**VIT.__dict__, "dtype": dtype, **vit_kw})
  lm = DecoderConfig(**{**LM.__dict__, "dtype": dtype})
  graphdef, state, sh = init_train_state(lambda r: VLM(vit, lm, r), tx, mesh, mesh_cfg.rules, 0)
  if dtype == "float64":
    state = TrainState(jax.tree.map(lambda p: p.astype(np.float64), state.params),
                       state.opt_state, state.version)
  fns = StepFunctions(graphdef, sh, tx, LossConfig(), mesh, mesh_cfg.rules,
                      forward=naive_vlm_forward(calls))
  return fns, state


def batches(plan, iplan, images_by_id, rng, fdtype=np.float32):
  """Global micro-batch k = consumer 0's k-th micro-batch, then consumer 1's, ...
  (each consumer's rows on its own batch shards). Returns (naive, dedup) lists."""
  naive, dedup = [], []
  for k in range(plan.num_micro_batches):
    metas = [m for c in range(len(plan.consumers)) for m in plan.consumers[c][k]]
    index = np.array([i for c in range(len(plan.consumers)) for i in iplan.index[c][k]], np.int32)
    B = len(metas)
    lengths = np.array([m.length for m in metas])
    attn = np.arange(T)[None] < lengths[:, None]
    loss_mask = (attn & (np.arange(T)[None] >= 3)).astype(np.float32)
    common = dict(tokens=np.where(attn, rng.integers(0, 64, (B, T)), 0).astype(np.int32),
                  attention_mask=attn, loss_mask=loss_mask.astype(fdtype),
                  behaviour_logp=np.where(loss_mask > 0, -rng.uniform(3.5, 4.5, (B, T)), 0).astype(fdtype),
                  advantages=rng.normal(size=B).astype(fdtype))
    naive.append({**common, "images": np.stack([images_by_id[m.image_ids[0]] for m in metas])})
    dedup.append({**common, "image_index": index})
  return naive, dedup


def slot_images(iplan, images_by_id, shape):
  return np.stack([images_by_id[i] if i is not None else np.zeros(shape, images_by_id[
      next(iter(images_by_id))].dtype) for i in iplan.slots])


def naive_grads(fns, state, naive, total):
  return micro_grads(fns, state, naive, total)[0]


def max_rel_err(got, want) -> dict:
  """max |got - want| / max |want| per parameter, the worst per top-level module."""
  got_leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(got))
  want_leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(want))
  out = {}
  for (path, g), (path_w, w) in zip(got_leaves, want_leaves, strict=True):
    assert path == path_w
    w, g = np.asarray(w), np.asarray(g)
    err = float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-300))
    top = str(path[0].key)
    out[top] = max(out.get(top, 0.0), err)
  return out


def setup(layout, calls, groups=3, n=8, micro=4, consumers=2, dtype="float32", seed=0):
  fns, state = build(layout, calls, dtype)
  rng = np.random.default_rng(seed)
  mb = mini_batch(groups, n, rng)
  plan = plan_micro_batches(mb, consumers, micro)
  shards = rows_multiple(fns.mesh, fns.rules)
  iplan = plan_images(plan.consumers, slot_multiple=max(1, shards // consumers))
  fdtype = np.float64 if dtype == "float64" else np.float32
  images = {f"img{g}": rng.random((VIT.image_size, VIT.image_size, 3)).astype(fdtype)
            for g in range(groups)}
  naive, dedup = batches(plan, iplan, images, rng, fdtype)
  total = sum(float(b["loss_mask"].sum()) for b in naive)
  return fns, state, plan, iplan, images, naive, dedup, total


def images_on(step, iplan, images):
  return jax.device_put(slot_images(iplan, images, (VIT.image_size, VIT.image_size, 3)),
                        step.images_sharding)


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_dedup_gradient_equals_naive_fp32_and_encodes_once(layout):
  naive_calls = EncoderCalls()
  fns, state, plan, iplan, images, naive, dedup, total = setup(layout, naive_calls)
  # The set-up must really share images across micro-batches and across consumers.
  where = {}
  for c, micros in enumerate(plan.consumers):
    for k, micro in enumerate(micros):
      for m in micro:
        where.setdefault(m.image_ids[0], set()).add((c, k))
  assert any(len({c for c, _ in w}) > 1 for w in where.values()), "no image straddles consumers"
  assert any(len({k for c, k in w if c == c0}) > 1 for w in where.values() for c0 in (0, 1)), \
      "no image straddles micro-batches within a consumer"
  rows = sum(len(b["tokens"]) for b in naive)
  want = naive_grads(fns, state, naive, total)
  jax.effects_barrier()
  assert naive_calls.forward_images == rows == 24 and naive_calls.backward_images == rows
  for residuals, forwards in (("keep", 1), ("recompute", 2)):
    calls = EncoderCalls()
    step = EncodeOnceStep(fns, EncodeOnceConfig(residuals=residuals), calls=calls)
    slots = images_on(step, iplan, images)
    for _ in range(2):  # two mini-batches: the counts are per mini-batch
      got, sums = step.mini_batch_grads(state.params, slots, dedup, total)
    errs = max_rel_err(got, want)
    assert set(errs) == {"encoder", "projector", "decoder"}
    assert max(errs.values()) <= 1e-5, (residuals, errs)
    assert float(sums["tokens"]) == total
    jax.effects_barrier()
    # One encoder call on the slots per mini-batch (a second one when recomputing),
    # one backward; each unique image holds exactly one slot (the rest are padding).
    assert calls.forward_calls == 2 * forwards and calls.backward_calls == 2, calls.as_dict()
    assert calls.forward_images == 2 * forwards * len(iplan.slots)
    assert calls.backward_images == 2 * len(iplan.slots)
    assert sorted(s for s in iplan.slots if s is not None) == sorted(images)
  if layout != "dp":
    return
  # The comparison can fail: one row given another image changes the gradient.
  bad = [dict(b) for b in dedup]
  real = [i for i, s in enumerate(iplan.slots) if s is not None]
  bad[0]["image_index"] = np.where(bad[0]["image_index"] == real[0], real[1], real[0]).astype(np.int32)
  got, _ = step.mini_batch_grads(state.params, slots, bad, total)
  assert max(max_rel_err(got, want).values()) > 1e-3
  # Kept residuals hold the ViT's activations; recomputing holds none.
  keep = EncodeOnceStep(fns, EncodeOnceConfig(residuals="keep"))
  enc = keep.encode(state.params, images_on(keep, iplan, images))
  assert sum(x.nbytes for x in jax.tree.leaves(enc.residuals)) > enc.embeds.nbytes
  assert step.encode(state.params, slots).residuals is None
  # A micro-batch without slots is named.
  acc, acc_e = fns.zero_grads(state.params), keep.zero_embed_grads(enc)
  with pytest.raises(ValueError, match="image_index"):
    keep.backbone(state.params, enc, acc, acc_e, naive[0], total)


def test_packed_dedup_step_equals_naive():
  """JobConfig.packing on the toy VLM: the 24 trajectories of 3 padded micro-batches
  packed 3 a row into one micro-batch, each segment its own image prefix
  (build_packed_batch's embed_index into E), give the naive step's gradient."""
  fns, state, plan, iplan, images, naive, dedup, total = setup("dp", None)
  want = naive_grads(fns, state, naive, total)
  P = VIT.num_tokens
  metas, toks, lps, masks, adv, slot_of = [], [], [], [], {}, {}
  for k, b in enumerate(dedup):
    for i, m in enumerate(m for c in range(len(plan.consumers)) for m in plan.consumers[c][k]):
      L = m.length
      metas.append(m)
      toks.append(b["tokens"][i, :L])
      lps.append(b["behaviour_logp"][i, :L])
      masks.append(b["loss_mask"][i, :L].astype(np.uint8))
      adv[m.id], slot_of[m.id] = float(b["advantages"][i]), int(b["image_index"][i])
  payload = Payload(metas, toks, lps, masks, {})
  row_of = {m.id: i % 8 for i, m in enumerate(metas)}  # 3 segments in each of 8 rows
  fill = np.zeros(8, int)
  for m in metas:
    fill[row_of[m.id]] += m.length + P
  r = int(fill.argmax())  # one position short there: the image prefix counts
  with pytest.raises(ValueError, match=rf"\+ {P} prefix\) does not fit packed row {r} of 8 x "):
    build_packed_batch(payload, adv, row_of, int(fill[r]) - 1, 8, P, slot_of)
  batch = build_packed_batch(payload, adv, row_of, 3 * (T + P), 8, P, slot_of)
  assert int(batch["segment_ids"].max()) == 3
  check_batch(batch, LM.vocab_size, 8)
  step = EncodeOnceStep(fns, EncodeOnceConfig())
  got, sums = step.mini_batch_grads(state.params, images_on(step, iplan, images), [batch], total)
  assert float(sums["tokens"]) == total
  errs = max_rel_err(got, want)
  assert max(errs.values()) <= 1e-5, errs


@pytest.mark.slow
def test_dedup_gradient_equals_naive_x64():
  # One layout here (the fp32 test covers both layouts and both residual modes):
  # float64 shows the gradient is exact, not merely close.
  with jax.enable_x64(True):
    for layout, residuals in (("fsdp", "keep"),):
      fns, state, plan, iplan, images, naive, dedup, total = setup(layout, None, dtype="float64")
      want = naive_grads(fns, state, naive, total)
      assert jax.tree.leaves(want)[0].dtype == np.float64
      step = EncodeOnceStep(fns, EncodeOnceConfig(residuals=residuals))
      got, _ = step.mini_batch_grads(state.params, images_on(step, iplan, images), dedup, total)
      errs = max_rel_err(got, want)
      assert max(errs.values()) <= 1e-10, (layout, residuals, errs)


def test_stochastic_encoder_is_refused():
  vit = ViTConfig(**{**VIT.__dict__, "dropout": 0.1})
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: VLM(vit, LM, nnx.Rngs(0)))
  with pytest.raises(StochasticEncoderError, match=r"encoder\.blocks\.0.*dropout with rate 0\.1"):
    check_deterministic(model)
    check_deterministic(nnx.eval_shape(lambda: VLM(VIT, LM, nnx.Rngs(0))))  # passes


def test_bad_config_is_named():
  with pytest.raises(ValueError, match="residuals = 'sometimes'"):
    EncodeOnceConfig(residuals="sometimes")


def test_image_plan_layout_and_errors():
  rng = np.random.default_rng(1)
  mb = mini_batch(3, 8, rng)
  plan = plan_micro_batches(mb, 2, 4)
  ip = plan_images(plan.consumers, slot_multiple=4)
  assert ip.num_unique == 3 and len(ip.slots) == 8 and ip.slots_per_consumer == 4
  assert sorted(i for o in ip.owned for i in o) == ["img0", "img1", "img2"]  # each once
  for c, owned in enumerate(ip.owned):  # owned images sit in the consumer's own slots
    assert set(owned) == {s for s in ip.consumer_slots(c) if s is not None}
  for c, micros in enumerate(plan.consumers):
    for k, micro in enumerate(micros):
      assert [ip.slots[i] for i in ip.index[c][k]] == [m.image_ids[0] for m in micro]
  # The owner is the consumer with the most rows of that image.
  for iid in ("img0", "img1", "img2"):
    rows = [sum(m.image_ids[0] == iid for mi in micros for m in mi) for micros in plan.consumers]
    owner = next(c for c, o in enumerate(ip.owned) if iid in o)
    assert rows[owner] == max(rows)
  assert plan_images(plan.consumers, min_slots=6, slot_multiple=4).slots_per_consumer == 8
  two = TrajMeta("u0", 0, 0, 3, 3, "vqa", 0, 0, 0, 0, 0.0, image_ids=("a", "b"))
  with pytest.raises(ImagePlanError, match=r"u0/0 has 2 images"):
    plan_images([[[two]]])


def test_vlm_train_forwards_form_no_vocab_sized_logits():
  """The VLM steps' forwards (naive and encode-once) hand the loss hidden states, so
  neither forms [B, T, vocab] logits: the largest vocab-sized array is one chunk's."""
  from knittrans_jax.models.vlm import vlm_forward
  from knittrans_jax.multimodal.encode_once import PrefixImages
  from knittrans_jax.rl.losses import ppo_loss_sum
  from knittrans_jax.train.program_arrays import largest_vocab_activation
  with nnx.use_eager_sharding(False):
    model = VLM(VIT, DecoderConfig(**{**LM.__dict__, "vocab_size": 96}), nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  B, T_, chunk = 2, 64, 8
  batch = {"tokens": np.zeros((B, T_), np.int32), "attention_mask": np.ones((B, T_), bool),
           "loss_mask": np.ones((B, T_), np.float32), "behaviour_logp": np.zeros((B, T_), np.float32),
           "advantages": np.ones(B, np.float32), "images": np.zeros((B, 16, 16, 3), np.float32),
           "image_index": np.array([0, 0], np.int32)}
  cfg = LossConfig(logprob_chunk=chunk)

  def naive(p):
    return ppo_loss_sum(vlm_forward(nnx.merge(graphdef, p), batch), batch, cfg)[0]

  def once(p):
    m = nnx.merge(graphdef, p)
    embeds = m.encode(batch["images"][:1])
    return ppo_loss_sum(PrefixImages().logits(m, embeds, batch), batch, cfg)[0]
  for fn in (naive, once):
    shape = largest_vocab_activation(jax.grad(fn), params, vocab=96)
    assert shape and shape[1] == chunk, shape
