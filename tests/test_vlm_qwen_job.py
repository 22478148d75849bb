"""The VLM job on a tiny random Qwen2-VL checkpoint (tests/hf_helpers.py): the vision
tasks as the checkpoint's token sequences, one rollout worker, disaggregated, each
unique image read once and encoded once per mini-batch; then, on the run's own store,
the encode-once step's gradient against the naive step's (the tower per trajectory)."""
import collections
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from hf_helpers import END, IMAGE, START, make_qwen_vl_checkpoint
from knittrans_jax.job.metrics import read_metrics
from knittrans_jax.job.trainer import BatchLayout, OnDemand, Trainer
from knittrans_jax.dataplane.packing import PackLayout
from knittrans_jax.suites import QwenVLSuite
from knittrans_jax.job.work import StepPlanner, image_slots
from knittrans_jax.models import qwen_vl
from knittrans_jax.models.vision_spec import VisionSpec
from knittrans_jax.models.vlm import make_model
from knittrans_jax.multimodal import EncodeOnceConfig, EncodeOnceStep, QwenVLImages, naive_qwen_forward
from knittrans_jax.rl import LossConfig
from knittrans_jax.rollout.qwen_vision_tasks import QwenVisionTasks
from knittrans_jax.storage import TrajectoryStore
from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, init_train_state,
                                 make_mesh, make_optimizer)
from knittrans_jax.train.batch import rows_multiple
from knittrans_jax.types import GroupInfo, MiniBatch
from test_multimodal_dedup import max_rel_err

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_SIZE = 16  # configs/vlm_qwen_tiny.gin: 4 x 4 patches of 4 px, 4 image-pad tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("qwen2_vl_tiny"))
  make_qwen_vl_checkpoint("qwen2_vl", path, seed=3)
  return path


@pytest.fixture(scope="module")
def run(checkpoint, tmp_path_factory):
  work = tmp_path_factory.mktemp("vlm_qwen") / "run"
  out = subprocess.run(
      [sys.executable, "scripts/train.py", "--gin_file", "configs/vlm_qwen_tiny.gin",
       "--workdir", str(work), "--gin_bindings", f"JobConfig.checkpoint = '{checkpoint}'",
       "--gin_bindings", "StoreSchema.retention = 'all'"],  # its rows are read after the run
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
  return work


@pytest.mark.slow
def test_vlm_qwen_job_end_to_end(run):
  summary = json.load(open(run / "summary.json"))
  recs = read_metrics(str(run))
  assert summary["steps"] == len(recs) == 4 and summary["quota_violations"] == 0
  ids = [i for r in recs for i in r["ids"]]
  store = TrajectoryStore.open(f"file://{run}/store")
  committed = store.list_committed()
  assert len(ids) == len(set(ids)) == summary["trajectories"] == 32  # each trained once
  assert set(ids) <= {m.id for m in committed}
  assert all(np.isfinite(r["loss"]) and 0.0 <= r["reward"] <= 1.0 for r in recs), recs
  # Each prompt: BOS, the image's 4 image-pad tokens between vision start and end,
  # marker, SEP; each group's uint8 image stored once for its 4 responses.
  for unit in store.units():
    metas = store.list_committed(unit)
    payload = store.read(metas).result()
    for m, tokens in zip(metas, payload.tokens):
      assert list(tokens[:7]) == [2, START] + [IMAGE] * 4 + [END] and m.prompt_len == 9
    assert len(store.reader(unit).image_ids()) == len({m.group_id for m in metas})
    assert all(im.dtype == np.uint8 and im.shape == (IMAGE_SIZE, IMAGE_SIZE, 3)
               for im in payload.images.values())


@pytest.mark.slow
def test_vlm_qwen_encode_once_equals_naive_on_the_runs_store(run, checkpoint):
  """One mini-batch of the run (2 groups, 2 consumers, so an image straddles them)
  through the job's trainer both ways: the same gradient to fp32 round-off."""
  store = TrajectoryStore.open(f"file://{run}/store")
  by_group = collections.defaultdict(list)
  for m in store.list_committed():
    by_group[m.group_id].append(m)
  groups = tuple(GroupInfo(g, ms[0].source, sum(m.length for m in ms), 0,
                           rewards=tuple(m.reward for m in ms), metas=tuple(ms))
                 for g, ms in sorted(by_group.items())[:2])
  spec = VisionSpec.from_qwen_checkpoint(checkpoint, IMAGE_SIZE)
  suite = QwenVisionTasks(spec)
  mesh_cfg = MeshConfig()  # dp over the 8 CPU devices
  mesh, rules = make_mesh(mesh_cfg), mesh_cfg.rules
  model, config = qwen_vl.load(checkpoint, "float32", mesh=mesh, rules=rules)
  tx = make_optimizer(OptimizerConfig())
  graphdef, state, sh = init_train_state(lambda r: make_model(None, spec, r), tx, mesh, rules,
                                         params=nnx.state(model, nnx.Param))
  fns = StepFunctions(graphdef, sh, tx, LossConfig(), mesh, rules,
                      forward=naive_qwen_forward(suite.grid))
  shards = rows_multiple(mesh, rules)
  work = StepPlanner(2, 8, image_slots=image_slots(shards, 2, 2))(
      MiniBatch(0, 0, groups, 0))
  # A random tiny policy rarely earns a reward, so GRPO's advantages are often all 0:
  # random ones instead, so that every parameter gets a gradient to compare.
  rng = np.random.default_rng(0)
  work = dataclasses.replace(work, advantages={i: float(rng.normal()) for i in work.advantages})
  assert {m.image_ids[0] for c in work.consumers for k in c for m in k} == {
      g.metas[0].image_ids[0] for g in groups}
  layout = BatchLayout(rows=8, seq_len=16, vocab_size=config.text.vocab_size, rows_multiple=shards)
  qwen = QwenVLSuite(spec)
  grads = {}
  for dedup in (False, True):
    step = EncodeOnceStep(fns, EncodeOnceConfig(), path=QwenVLImages(config.vision.merge)) if dedup else None
    fields = qwen.shared_fields(layout, step) if dedup else qwen.naive_fields(layout)
    trainer = Trainer(fns, state, OnDemand(store), layout, [0, 1], fields=fields,
                      shared_step=step)
    grads[dedup] = jax.device_get(trainer.step(work, apply=False).grads)
    trainer.close()
  # Packed (JobConfig.packing): two trajectories a row of 32 tokens, M-RoPE per segment.
  packed = StepPlanner(2, 8, image_slots=image_slots(shards, 2, 2),
                       pack=PackLayout(row_tokens=32, max_rows=4, row_unit=4))(
      MiniBatch(0, 0, groups, 0))
  packed = dataclasses.replace(packed, advantages=work.advantages)
  assert any(len(set(rows)) < len(rows) for c in packed.rows for rows in c)  # rows shared
  step = EncodeOnceStep(fns, EncodeOnceConfig(), path=QwenVLImages(config.vision.merge))
  trainer = Trainer(fns, state, OnDemand(store), dataclasses.replace(layout, seq_len=32), [0, 1],
                    fields=qwen.shared_fields(layout, step), shared_step=step)
  grads["packed"] = jax.device_get(trainer.step(packed, apply=False).grads)
  trainer.close()
  errs = max_rel_err(grads[True], grads[False])
  print(f"encode-once vs naive on the run's store: max relative gradient error {errs}")
  assert set(errs) == {"visual", "decoder"} and max(errs.values()) <= 1e-5, errs
  assert max(max_rel_err(grads["packed"], grads[False]).values()) <= 1e-5
  assert min(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads[True])) > 0


def test_vision_suite_refuses_a_text_checkpoint_and_a_colliding_vocabulary(tmp_path, checkpoint):
  from knittrans_jax.admission import TrainBatchSpec
  from knittrans_jax.job.config import JobConfig
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
  with pytest.raises(ValueError, match=r"has model_type 'qwen2': the 'vision' suite takes a "
                                       r"Qwen-VL checkpoint"):
    JobConfig(spec=TrainBatchSpec(4, 4, 2), suite="vision", checkpoint=str(tmp_path),
              micro_batch_size=8)
  spec = VisionSpec.from_qwen_checkpoint(checkpoint, IMAGE_SIZE)
  with pytest.raises(ValueError, match=r"the vision ids above 63 \(these are not: "
                                       r"\{'vision_start_token_id': 5\}\)"):
    QwenVisionTasks(dataclasses.replace(spec, vision_start=5))
