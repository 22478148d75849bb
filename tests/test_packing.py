"""Packed training (JobConfig.packing): the planner packs every trajectory exactly once
into rows of the token budget, in lockstep micro-batches of a few row counts; a
packed step's loss, gradients and metrics equal the padded step's on the same
trajectories (fp32 round-off), with tied and untied heads, KL on, and masked
observation tokens inside responses; a trajectory longer than a row is named."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from knittrans_jax.dataplane.packing import (PackLayout, TooLongError, first_fit_decreasing,
                                             pack_micro_batches)
from knittrans_jax.job.batching import build_batch, build_packed_batch
from knittrans_jax.job.work import StepPlanner
from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rl import LossConfig
from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, check_batch,
                                 init_train_state, make_mesh, make_optimizer)
from knittrans_jax.types import GroupInfo, MiniBatch, Payload, TrajMeta

T = 48  # packed row tokens, and the padded rows' length
N = 4  # group size


def test_first_fit_decreasing_packs_each_item_once_within_capacity():
  rng = np.random.default_rng(0)
  for _ in range(50):
    lengths = rng.integers(1, 40, rng.integers(1, 60)).tolist()
    rows = first_fit_decreasing(lengths, 40)
    fill = np.bincount(rows, weights=lengths)
    assert fill.max() <= 40 and len(rows) == len(lengths)
    assert len(fill) <= 11 / 9 * -(-sum(lengths) // 40) + 1  # FFD's bound, with OPT >= this
  with pytest.raises(TooLongError, match="item 1 of 41 tokens does not fit a row of 40"):
    first_fit_decreasing([3, 41], 40)


def test_micro_batches_are_lockstep_and_take_a_few_row_counts():
  layout = PackLayout(row_tokens=10, max_rows=8, row_unit=2)
  assert layout.shapes() == [2, 4, 8]
  rng = np.random.default_rng(1)
  for _ in range(30):
    lengths = [rng.integers(1, 11, rng.integers(0, 40)).tolist() for _ in range(3)]
    micro = pack_micro_batches(lengths, layout)
    seen = [sorted(i for mb in micro for i, _ in mb.items[c]) for c in range(3)]
    assert seen == [list(range(len(ls))) for ls in lengths]  # each exactly once
    for mb in micro:
      assert mb.rows in layout.shapes()
      for c in range(3):
        fill = np.zeros(mb.rows)
        for i, r in mb.items[c]:
          fill[r] += lengths[c][i]
        assert fill.max(initial=0) <= 10


def _trajectories(seed: int, groups: int, long: bool = False):
  """Groups of N trajectories of 6-48 tokens (a 4-token prompt), some with masked
  observation runs inside the response; versions 0 or 1 (0: lag 0 at version 0)."""
  rng = np.random.default_rng(seed)
  metas, data, pos = [], {}, 0
  for g in range(groups):
    for i in range(N):
      L = int(rng.integers(6, T + 1)) if not (long and g == 0 and i == 0) else T + 3
      tokens = rng.integers(0, 64, L).astype(np.int32)
      mask = np.zeros(L, np.uint8)
      mask[4:] = 1
      if rng.random() < 0.5 and L > 12:  # an observation inside the response
        a = int(rng.integers(6, L - 4))
        mask[a:a + 3] = 0
      logp = np.where(mask, -rng.uniform(3.5, 4.5, L), 0).astype(np.float32)
      v = int(rng.integers(0, 2))
      m = TrajMeta(f"u{g % 2}", pos, 0, 4, L - 4, "s", g, i, v, v, float(rng.normal()),
                   loss_tokens=int(mask.sum()))
      pos += 1
      metas.append(m)
      data[m.id] = (tokens, logp, mask)
  mb = MiniBatch(0, 0, tuple(GroupInfo.from_metas(metas[g * N:(g + 1) * N])
                             for g in range(groups)), 0)
  return mb, data


def _payload(metas, data) -> Payload:
  return Payload(list(metas), [data[m.id][0] for m in metas], [data[m.id][1] for m in metas],
                 [data[m.id][2] for m in metas], {})


def _build(cfg: DecoderConfig, loss: LossConfig):
  import gin
  gin.clear_config()
  gin.parse_config_file("configs/mesh/dp.gin")
  mesh_cfg = MeshConfig()
  gin.clear_config()
  mesh = make_mesh(mesh_cfg)
  tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
  graphdef, state, shardings = init_train_state(lambda r: DecoderLM(cfg, r), tx, mesh,
                                                mesh_cfg.rules, 0)
  return StepFunctions(graphdef, shardings, tx, loss, mesh, mesh_cfg.rules), state


def _run(fns, state, batches, total, ref):
  acc = fns.zero_grads(state.params)
  sums = fns.zero_sums(state, batches[0], ref)
  for b in batches:
    check_batch(b, 64, 8)
    acc, sums = fns.micro_step(state, acc, sums, b, total, ref)
  return jax.device_get((acc, sums))


@pytest.mark.parametrize("tie, kl, attention", [(False, 0.0, "einsum"), (True, 0.1, "blockwise")])
def test_packed_step_equals_padded_step(tie, kl, attention):
  """The padded step with the einsum attention against the packed step with `attention`
  (blockwise: tiles of 16 tokens, grouped key/value heads, models/blockwise_attention.py)."""
  cfg = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64,
                      tie_embeddings=tie, kv_heads=2)
  fns, state = _build(cfg, LossConfig(kl_coef=kl))
  fns_packed = fns
  if attention != "einsum":  # the same parameters, another attention
    fns_packed, _ = _build(dataclasses.replace(cfg, attention=attention, attention_block=16),
                           LossConfig(kl_coef=kl))
  ref = None
  if kl:  # a reference other than the policy, so the KL term is not zero
    ref = jax.tree.map(lambda x: x * 1.01, state.params)
  mb, data = _trajectories(seed=3, groups=12)
  mine = [0, 1]
  padded = StepPlanner(2, 8)(mb)
  packed = StepPlanner(2, 8, pack=PackLayout(row_tokens=T, max_rows=4, row_unit=4))(mb)
  assert padded.total_tokens == packed.total_tokens
  assert packed.num_micro_batches < padded.num_micro_batches  # fewer rows computed
  pad_batches = [build_batch(_payload(ms, data), padded.advantages, T, 8)
                 for ms in padded.local_micro_batches(mine)]
  pack_batches = []
  for k, ms in enumerate(packed.local_micro_batches(mine)):
    rows, row_of = packed.local_rows(mine, k)
    pack_batches.append(build_packed_batch(_payload(ms, data), packed.advantages, row_of, T, rows))
  assert max(int(b["segment_ids"].max()) for b in pack_batches) > 1  # rows really shared
  total = np.float32(padded.total_tokens)
  g_pad, s_pad = _run(fns, state, pad_batches, total, ref)
  g_pack, s_pack = _run(fns_packed, state, pack_batches, total, ref)
  assert set(s_pad) == set(s_pack)
  assert s_pad["fresh_tokens"] > 0 and (not kl or s_pad["kl"] > 0)
  for k in s_pad:
    np.testing.assert_allclose(s_pack[k], s_pad[k], rtol=2e-5, atol=1e-6, err_msg=k)
  flat_pad, flat_pack = jax.tree.leaves(g_pad), jax.tree.leaves(g_pack)
  scale = max(float(np.abs(g).max()) for g in flat_pad)
  for a, b in zip(flat_pack, flat_pad):
    np.testing.assert_allclose(a, b, atol=2e-5 * scale, rtol=0)


def test_a_trajectory_longer_than_a_row_is_named_before_anything_trains():
  mb, _ = _trajectories(seed=4, groups=2, long=True)
  with pytest.raises(TooLongError, match=r"trajectory u0/0 \(group 0\) has 51 tokens \(4 prompt "
                                         r"\+ 47 response\), more than a packed row's 48"):
    StepPlanner(2, 8, pack=PackLayout(row_tokens=T, max_rows=4, row_unit=4))(mb)


def test_segments_do_not_see_each_other():
  """Two sequences packed in one row give each its own logits: the decoder attends
  within a segment and restarts positions."""
  cfg = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64)
  with nnx.use_eager_sharding(False):
    model = DecoderLM(cfg, nnx.Rngs(0))
  rng = np.random.default_rng(5)
  a, b = rng.integers(0, 64, 7), rng.integers(0, 64, 5)
  alone = [np.asarray(model(x[None], np.ones((1, x.size), bool)))[0] for x in (a, b)]
  row = np.concatenate([a, b, np.zeros(4, int)])[None]
  seg = np.array([[1] * 7 + [2] * 5 + [0] * 4])
  pos = np.array([list(range(7)) + list(range(5)) + [0] * 4])
  out = np.asarray(model(row, seg > 0, positions=pos, segment_ids=seg))[0]
  np.testing.assert_allclose(out[:7], alone[0], atol=1e-5)
  np.testing.assert_allclose(out[7:12], alone[1], atol=1e-5)


def test_the_first_step_compiles_every_packed_row_count():
  """A packed row count met first mid-run would stall that step on tracing and
  compiling: the trainer compiles the other counts at its first micro-batch, on
  all-padding batches, and leaves the state as it was."""
  from knittrans_jax.job.trainer import BatchLayout, Centralized, Trainer
  cfg = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64, kv_heads=2)
  fns, state = _build(cfg, LossConfig())
  mb, data = _trajectories(seed=3, groups=12)
  packed = StepPlanner(1, 16, pack=PackLayout(row_tokens=T, max_rows=16, row_unit=8))(mb)
  rows, row_of = packed.local_rows([0], 0)
  batch = build_packed_batch(_payload(packed.local_micro_batches([0])[0], data),
                             packed.advantages, row_of, T, rows)
  layout = BatchLayout(rows=16, seq_len=T, vocab_size=64, rows_multiple=8, packed_rows=(8, 16))
  trainer = Trainer(fns, state, Centralized(fetch=None), layout)
  before = jax.device_get(state.params)

  def compiled():
    return {dict(key[1])["tokens"][0] for key in fns._jitted if key[0] == "micro"}
  trainer._warm_packed_shapes({k: np.asarray(v) for k, v in batch.items()})
  assert compiled() == {8, 16} - {rows}  # the one it was given compiles when it runs
  assert trainer._warmed
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.state.params), before)
