"""Encode-once with the real Qwen2.5-VL tower (a tiny random checkpoint made by
transformers): exactly the naive gradient (plain jax.grad of the mini-batch's summed
loss, the tower on every trajectory's own copy of its image), the tower run once per
unique image per mini-batch, both residual modes, under every mesh layout; count
mismatches named.

The fp32 naive gradient is computed once, under `dp`, and each layout's encode-once
gradient is compared with it: the naive gradient is one function of the parameters,
and compiling the naive step per layout would double the file's time. Under x64
both are computed under `fsdp`."""
import gin
import jax
import numpy as np
import pytest
from flax import nnx

from hf_helpers import END, IMAGE, START, make_qwen_vl_checkpoint
from knittrans_jax.dataplane import plan_micro_batches
from knittrans_jax.job.batching import build_packed_batch, segment_spans
from knittrans_jax.mesh import replicated
from knittrans_jax.models import qwen_vl
from knittrans_jax.models.hf import read_config
from knittrans_jax.multimodal import (EncodeOnceConfig, EncodeOnceStep, EncoderCalls, QwenVLImages,
                                      image_fields, packed_image_fields, plan_images, plan_pack)
from knittrans_jax.rl import LossConfig
from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, init_train_state,
                                 make_mesh, make_optimizer)
from knittrans_jax.train.batch import batch_shardings, rows_multiple
from knittrans_jax.types import GroupInfo, MiniBatch, Payload, TrajMeta
from test_multimodal_dedup import max_rel_err

FAMILY = "qwen2_5_vl"  # windowed attention with one full layer: the harder tower
# Two images of different sizes: 15 and 8 merged patches, partial 2 x 2 windows.
GRIDS = {"img0": (1, 6, 10), "img1": (1, 8, 4)}
N, CONSUMERS, MICRO = 8, 4, 2  # 16 rows -> 4 consumers x 2 micro-batches of 2 rows each
T = 28  # the longest prompt (22 tokens) plus 6 response tokens
# One decoder layer and a tower of one windowed and one full-attention layer: every
# kind of layer, at the least compile time.
TEXT, VISION = dict(num_hidden_layers=1), dict(depth=2, fullatt_block_indexes=[1])


def prompt(image_id, rng):
  merged = int(np.prod(GRIDS[image_id])) // 4
  return rng.integers(2, IMAGE, 2).tolist() + [START] + [IMAGE] * merged + [END] + \
      rng.integers(2, IMAGE, 3).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = str(tmp_path_factory.mktemp(FAMILY))
  make_qwen_vl_checkpoint(FAMILY, path, text=TEXT, vision=VISION)
  return path


@pytest.fixture(scope="module")
def data():
  """The mini-batch (2 groups of n = 8, one image each), its plan and each row's
  tokens; the images' pixel_values (float64, cast per test)."""
  rng = np.random.default_rng(0)
  groups, tokens = [], {}
  for g, iid in enumerate(GRIDS):
    p = prompt(iid, rng)
    metas = []
    for i in range(N):
      resp = rng.integers(2, IMAGE, int(rng.integers(2, 7))).tolist()
      m = TrajMeta(unit="u0", row=g * N + i, token_start=0, prompt_len=len(p),
                   response_len=len(resp), source="vqa", group_id=g, index_in_group=i,
                   version_first=0, version_last=0, reward=0.0, image_ids=(iid,))
      tokens[m.id] = p + resp
      metas.append(m)
    groups.append(GroupInfo(g, "vqa", sum(m.length for m in metas), 0, metas=tuple(metas)))
  plan = plan_micro_batches(MiniBatch(0, 0, tuple(groups), 0), CONSUMERS, MICRO)
  pixels = {iid: rng.standard_normal((int(np.prod(g)), 96)) for iid, g in GRIDS.items()}
  return plan, tokens, pixels


def micro_batches(plan, tokens, rng, fdtype):
  """Global micro-batch k = consumer 0's k-th micro-batch, then consumer 1's, ...;
  each as (the text fields, its metas)."""
  out = []
  for k in range(plan.num_micro_batches):
    metas = [m for micros in plan.consumers for m in micros[k]]
    B = len(metas)
    ids = np.zeros((B, T), np.int32)
    for b, m in enumerate(metas):
      ids[b, :m.length] = tokens[m.id]
    lengths = np.array([m.length for m in metas])
    attn = np.arange(T)[None] < lengths[:, None]
    loss_mask = attn & (np.arange(T)[None] >= np.array([m.prompt_len for m in metas])[:, None])
    out.append(({"tokens": ids, "attention_mask": attn, "loss_mask": loss_mask.astype(fdtype),
                 "behaviour_logp": np.where(loss_mask, -rng.uniform(3.5, 4.5, (B, T)),
                                            0).astype(fdtype),
                 "advantages": rng.normal(size=B).astype(fdtype)}, metas))
  return out


def build(checkpoint, layout, dtype):
  gin.clear_config()
  gin.parse_config_file(f"configs/mesh/{layout}.gin")
  mesh_cfg = MeshConfig()
  gin.clear_config()
  mesh, rules = make_mesh(mesh_cfg), mesh_cfg.rules
  model, config = qwen_vl.load(checkpoint, dtype, mesh=mesh, rules=rules)
  tx = make_optimizer(OptimizerConfig())
  graphdef, state, sh = init_train_state(lambda r: qwen_vl.QwenVL(config, r), tx, mesh, rules,
                                         params=nnx.state(model, nnx.Param))
  return StepFunctions(graphdef, sh, tx, LossConfig(), mesh, rules), state.params, config


def naive_grads(fns, params, micros, pixels, config, total, calls):
  """The reference: plain jax.grad of the mini-batch's summed loss, every row's own copy
  of its image through the tower (the model's row-major image_embeds path). One call
  over all the rows: the gradient of a sum is the sum of the micro-batches' gradients,
  and one compile is half the naive side's time here."""
  text = {k: np.concatenate([t[k] for t, _ in micros]) for k in micros[0][0]}
  metas = [m for _, ms in micros for m in ms]
  grid = tuple(GRIDS[m.image_ids[0]] for m in metas)
  pixel_values = np.concatenate([pixels[m.image_ids[0]] for m in metas])
  positions, _ = qwen_vl.mrope_positions(text["tokens"], np.asarray(grid), config,
                                         text["attention_mask"])

  def loss(p, batch, pv, pos):
    model = nnx.merge(fns.graphdef, p)
    embeds = calls.tag(model.encode(pv, grid), len(grid))
    logits = model(batch["tokens"], batch["attention_mask"], positions=pos, image_embeds=embeds)
    return fns.objective_sum(logits, batch)[0] / total

  repl = replicated(fns.mesh)
  grad = jax.jit(jax.grad(loss), in_shardings=(
      fns.shardings.params, batch_shardings(fns.mesh, fns.rules, text), repl, repl),
      out_shardings=fns.shardings.params)
  return grad(params, text, pixel_values, positions)


def encode_once_inputs(fns, config, plan, micros, pixels):
  shards = rows_multiple(fns.mesh, fns.rules)
  iplan = plan_images(plan.consumers)
  # Each consumer's chunk of E splits over its share of the batch shards.
  pack = plan_pack(iplan, GRIDS, config.vision.merge, max(1, shards // CONSUMERS))
  dedup = [{**text, **image_fields(text["tokens"], text["attention_mask"],
                                   [m.image_ids for m in metas], pack, config)}
           for text, metas in micros]
  return pack, dedup


def packed_micro_batch(micros, pack, config) -> dict:
  """The padded micro-batches' trajectories packed two a row (job/batching), with
  packed_image_fields' per-segment M-RoPE positions and rows of E."""
  metas, toks, lps, masks, adv = [], [], [], [], {}
  for text, ms in micros:
    for b, m in enumerate(ms):
      metas.append(m)
      toks.append(text["tokens"][b, :m.length])
      lps.append(text["behaviour_logp"][b, :m.length])
      masks.append(text["loss_mask"][b, :m.length].astype(np.uint8))
      adv[m.id] = float(text["advantages"][b])
  payload = Payload(metas, toks, lps, masks, {})
  rows = len(metas) // 2
  row_of = {m.id: i % rows for i, m in enumerate(metas)}
  batch = build_packed_batch(payload, adv, row_of, 2 * T, rows)
  spans = segment_spans(payload, row_of, 2 * T, rows)
  batch.update(packed_image_fields(batch["tokens"], spans, [m.image_ids for m in metas], pack,
                                   config))
  return batch


@pytest.fixture(scope="module")
def naive_fp32(checkpoint, data):
  """(micro-batches, total loss tokens, the naive gradient on the host), under dp."""
  plan, tokens, pixels = data
  fns, params, config = build(checkpoint, "dp", "float32")
  micros = micro_batches(plan, tokens, np.random.default_rng(1), np.float32)
  total = sum(float(t["loss_mask"].sum()) for t, _ in micros)
  calls = EncoderCalls()
  want = jax.device_get(naive_grads(fns, params, micros, f32(pixels), config, total, calls))
  jax.effects_barrier()
  assert calls.forward_images == calls.backward_images == 2 * N  # the tower on every row
  return micros, total, want


def f32(pixels):
  return {k: v.astype(np.float32) for k, v in pixels.items()}


def encode_once_grads(fns, params, config, pack, pixels, dedup, total, residuals, calls=None):
  step = EncodeOnceStep(fns, EncodeOnceConfig(residuals=residuals), calls=calls,
                        path=QwenVLImages(config.vision.merge))
  images = jax.device_put(pack.images(pixels), step.images_sharding)
  grads, sums = step.mini_batch_grads(params, images, dedup, total)
  return step, images, grads, sums


# fsdp_tp (the tower's heads and MLP split over 'tensor') adds ~17 s of compiling on
# this 2-core machine, so it runs with the slow tests (make test runs them all).
@pytest.mark.parametrize("layout", ["dp", "fsdp", pytest.param("fsdp_tp", marks=pytest.mark.slow)])
def test_encode_once_gradient_equals_naive_fp32(checkpoint, data, naive_fp32, layout):
  plan, _, pixels = data
  pixels = f32(pixels)
  micros, total, want = naive_fp32
  # Images really straddle consumers and micro-batches.
  where = {}
  for c, consumer in enumerate(plan.consumers):
    for k, micro in enumerate(consumer):
      for m in micro:
        where.setdefault(m.image_ids[0], set()).add((c, k))
  assert all(len({c for c, _ in w}) > 1 for w in where.values()), where
  assert any(len({k for c, k in w if c == c0}) > 1 for w in where.values()
             for c0 in range(CONSUMERS)), where
  assert len(micros) == 2
  fns, params, config = build(checkpoint, layout, "float32")
  pack, dedup = encode_once_inputs(fns, config, plan, micros, pixels)
  assert sorted(i for i in pack.ids if i is not None) == sorted(GRIDS)  # each image once
  errors, steps = {}, {}
  for residuals, forwards in (("keep", 1), ("recompute", 2)):
    calls = EncoderCalls()
    steps[residuals], images, got, sums = encode_once_grads(fns, params, config, pack, pixels,
                                                            dedup, total, residuals, calls)
    errs = errors[residuals] = max_rel_err(got, want)
    assert set(errs) == {"visual", "decoder"}
    assert max(errs.values()) <= 1e-5, (layout, residuals, errs)
    assert float(sums["tokens"]) == total
    jax.effects_barrier()
    # One tower call on the pack per mini-batch (two when recomputing), one backward:
    # the 2 unique images once each, plus the padding images that even out the chunks.
    assert calls.forward_calls == forwards and calls.backward_calls == 1, calls.as_dict()
    assert calls.forward_images == forwards * len(pack.grid)
    assert calls.backward_images == len(pack.grid)
  print(f"{layout} fp32: max relative gradient error {errors}; pack {pack.grid}")
  if layout != "dp":
    return
  # Packed (JobConfig.packing): the 16 trajectories two a row in one micro-batch, M-RoPE
  # restarting per segment, give the same gradient.
  packed = packed_micro_batch(micros, pack, config)
  assert int(packed["segment_ids"].max()) == 2
  got, sums = steps["keep"].mini_batch_grads(params, images, [packed], total)
  assert float(sums["tokens"]) == total
  assert max(max_rel_err(got, want).values()) <= 1e-5
  # The comparison can fail: one row reading its image's embeddings one row of E off.
  bad = [dict(b) for b in dedup]
  row = bad[0]["tokens"][0] == IMAGE
  bad[0]["embed_index"] = bad[0]["embed_index"].copy()
  bad[0]["embed_index"][0] = np.where(row, (bad[0]["embed_index"][0] + 1) % pack.num_rows, 0)
  keep = steps["keep"]
  got, _ = keep.mini_batch_grads(params, images, bad, total)
  assert max(max_rel_err(got, want).values()) > 1e-3
  # Recomputing holds no residuals; keeping holds the tower's activations.
  assert steps["recompute"].encode(params, images).residuals is None
  enc = keep.encode(params, images)
  assert sum(x.nbytes for x in jax.tree.leaves(enc.residuals)) > enc.embeds.nbytes
  # A pack that does not split over the batch shards is named before jit sees it.
  odd = plan_pack(plan_images(plan.consumers), GRIDS, 2, unit_multiple=1)
  with pytest.raises(ValueError, match=r"60 rows of E \(240 patches / merge\^2\) do not split "
                                       r"over 8 batch shards"):
    keep.encode(params, odd.images(pixels))
  # A naive micro-batch (pixel_values, no embed_index) is refused by name.
  with pytest.raises(ValueError, match=r"\['embed_index', 'positions'\]"):
    keep.backbone(params, enc, fns.zero_grads(params), keep.zero_embed_grads(enc),
                  {**micros[0][0], "pixel_values": pixels["img0"]}, total)


@pytest.mark.slow
def test_encode_once_gradient_equals_naive_x64(checkpoint, data):
  # float64 parameters and activations: the gradient is exact, not merely close.
  plan, tokens, pixels = data
  with jax.enable_x64(True):
    fns, params, config = build(checkpoint, "fsdp", "float64")
    assert jax.tree.leaves(params)[0].dtype == np.float64
    micros = micro_batches(plan, tokens, np.random.default_rng(1), np.float64)
    total = sum(float(t["loss_mask"].sum()) for t, _ in micros)
    want = naive_grads(fns, params, micros, pixels, config, total, EncoderCalls())
    pack, dedup = encode_once_inputs(fns, config, plan, micros, pixels)
    errors = {}
    for residuals in ("keep", "recompute"):
      _, _, got, _ = encode_once_grads(fns, params, config, pack, pixels, dedup, total, residuals)
      assert jax.tree.leaves(got)[0].dtype == np.float64
      errors[residuals] = max_rel_err(got, want)
    print(f"fsdp x64: max relative gradient error {errors}")
    assert max(max(e.values()) for e in errors.values()) <= 1e-10, errors


def test_image_token_counts_are_named(checkpoint, data):
  """A run of image-pad tokens that is not its image's size names both counts; so does
  a row whose runs and images do not pair up."""
  plan, tokens, _ = data
  config = qwen_vl.config_from_hf(read_config(checkpoint))
  pack = plan_pack(plan_images(plan.consumers), GRIDS, 2, unit_multiple=2)
  text, metas = micro_batches(plan, tokens, np.random.default_rng(1), np.float32)[0]
  images = [m.image_ids for m in metas]
  b = next(i for i, m in enumerate(metas) if m.image_ids == ("img0",))
  short = text["tokens"].copy()
  short[b, np.flatnonzero(short[b] == IMAGE)[-1]] = 5  # the image loses a pad token
  start = int(np.flatnonzero(short[b] == IMAGE)[0])
  with pytest.raises(ValueError, match=rf"row {b}: image 'img0' has 15 merged patches \(grid "
                                       rf"\(1, 6, 10\), merge 2\) but its run of image-pad "
                                       rf"tokens at {start} has 14"):
    image_fields(short, text["attention_mask"], images, pack, config)
  two = [list(i) for i in images]
  two[b] = ["img0", "img1"]
  with pytest.raises(ValueError, match=rf"row {b}: 1 run\(s\) of image-pad tokens \(id {IMAGE}\) "
                                       r"but 2 image\(s\) \['img0', 'img1'\]"):
    image_fields(text["tokens"], text["attention_mask"], two, pack, config)
  # The fields themselves: each image-pad token reads its image's rows of E in order,
  # and positions are mrope_positions' with the rows first.
  fields = image_fields(text["tokens"], text["attention_mask"], images, pack, config)
  first, merged = pack.where("img0")
  np.testing.assert_array_equal(fields["embed_index"][b][text["tokens"][b] == IMAGE],
                                np.arange(first, first + merged))
  grid = np.asarray([GRIDS[i[0]] for i in images])
  pos, _ = qwen_vl.mrope_positions(text["tokens"], grid, config, text["attention_mask"])
  np.testing.assert_array_equal(fields["positions"], pos.transpose(1, 0, 2))
  # Packed: the same counts, named with the packed row and the segment's span.
  spans = [(0, 0, int(text["attention_mask"][i].sum())) for i in range(len(metas))]
  with pytest.raises(ValueError, match=rf"packed row 0, segment at \[0, {spans[b][2]}\): row 0: "
                                       rf"image 'img0' has 15 merged patches"):
    packed_image_fields(short[b:b + 1], [spans[b]], [images[b]], pack, config)
