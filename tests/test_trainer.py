"""The trainer's one entry point (job/trainer.py) on a real store: no host round trip
inside a step, the next mini-batch read while the current one trains, the data
paths and step kinds agreeing, and damaged images quarantined in encode-once."""
from __future__ import annotations

import contextlib
import os
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from knittrans_jax.dataplane.centralized import local_driver
from knittrans_jax.job.trainer import BatchLayout, Centralized, OnDemand, Trainer
from knittrans_jax.suites import VisionSuite
from knittrans_jax.job.work import StepPlanner, image_slots
from knittrans_jax.models import DecoderConfig
from knittrans_jax.models.vision_spec import VisionSpec
from knittrans_jax.models.vit import ViTConfig
from knittrans_jax.models.vlm import make_model
from knittrans_jax.multimodal import EncodeOnceConfig, EncodeOnceStep, naive_vlm_forward
from knittrans_jax.rl import LossConfig
from knittrans_jax.storage import StoreSchema, TrajectoryStore, image_id
from knittrans_jax.storage.quarantine import QuarantiningReader
from knittrans_jax.train import (MeshConfig, OptimizerConfig, StepFunctions, init_train_state,
                                 make_mesh, make_optimizer)
from knittrans_jax.train.batch import rows_multiple
from knittrans_jax.train.step import text_forward
from knittrans_jax.types import GroupInfo, MiniBatch, Trajectory

N, G_PER_MB, SEQ, MICRO = 4, 4, 16, 8
VIT = ViTConfig(image_size=16, patch_size=4, width=32, depth=1, heads=4, mlp_width=64)
LM = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64)


def build_store(root, vision: bool, mini_batches: int = 3, seed: int = 0):
  rng = np.random.default_rng(seed)
  store = TrajectoryStore.create(f"file://{root}", StoreSchema(
      sources=("s",), max_prompt_len=SEQ, max_response_len=SEQ))
  writers = [store.writer(f"w{p}") for p in range(2)]
  out = []
  for k in range(mini_batches):
    groups = []
    for g in range(G_PER_MB):
      gid = k * G_PER_MB + g
      images, ids = [], ()
      if vision:
        img = rng.random((16, 16, 3), dtype=np.float32)
        images, ids = [img], (image_id(img),)
      prompt = rng.integers(2, 64, 4, dtype=np.int32)
      trajs = []
      for i in range(N):
        R = int(rng.integers(3, SEQ - 4))
        trajs.append(Trajectory(prompt, rng.integers(2, 64, R, dtype=np.int32),
                                -rng.uniform(3.5, 4.5, R).astype(np.float32), np.ones(R, bool),
                                float(rng.random()), "s", gid, i, (0,), ids))
      metas = writers[gid % 2].append(trajs, images=images)
      groups.append(GroupInfo.from_metas(metas))
    out.append(MiniBatch(k, 0, tuple(groups), 0))
  return store, out


_BUILT = {}  # vision -> (fns, state0, EncodeOnceStep): compiled once per module


def make_trainer(store, vision=False, encode_once=False, centralized=False, consumers=2,
                 quarantine=None):
  if vision not in _BUILT:
    gin.clear_config()
    mesh_cfg = MeshConfig()
    mesh = make_mesh(mesh_cfg)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    graphdef, state0, sh = init_train_state(
        lambda r: make_model(LM, VisionSpec.tiny(VIT) if vision else None, r), tx, mesh, mesh_cfg.rules, 0)
    fns = StepFunctions(graphdef, sh, tx, LossConfig(), mesh, mesh_cfg.rules,
                        forward=naive_vlm_forward() if vision else text_forward)
    _BUILT[vision] = (fns, state0, EncodeOnceStep(fns, EncodeOnceConfig()) if vision else None)
  fns, state0, eo = _BUILT[vision]
  rm = rows_multiple(fns.mesh, fns.rules)
  layout = BatchLayout(rows=MICRO, seq_len=SEQ, vocab_size=LM.vocab_size, rows_multiple=rm)
  suite = VisionSuite(VisionSpec.tiny(VIT))
  fields = (None if not vision else suite.shared_fields(layout, eo) if encode_once
            else suite.naive_fields(layout))
  data = (Centralized(local_driver(store)) if centralized else
          OnDemand(store, read=quarantine.read if quarantine else None))
  # A copy: the trainer's steps donate its state.
  trainer = Trainer(fns, jax.tree.map(jnp.copy, state0), data, layout, range(consumers),
                    fields=fields, shared_step=eo if encode_once else None,
                    quarantine=quarantine)
  planner = StepPlanner(consumers, MICRO, image_slots=image_slots(
      rm, consumers, G_PER_MB) if encode_once else None)
  return trainer, planner


@contextlib.contextmanager
def no_device_to_host():
  """jax's transfer guard (what catches a sync on GPU/TPU) plus a check that works on
  the CPU backend, where a device array's host view is zero-copy and the guard sees
  nothing: every host read of a jax.Array (ArrayImpl._value) raises here."""
  impl = type(jax.numpy.zeros(()))  # jax.Array's concrete class, without a private import
  original = impl._value

  def guarded(self):
    raise AssertionError("Disallowed device-to-host transfer: a jax.Array read on the host")
  impl._value = property(guarded)
  try:
    with jax.transfer_guard_device_to_host("disallow"):
      yield
  finally:
    impl._value = original


@pytest.fixture(scope="module")
def text_store(tmp_path_factory):
  return build_store(tmp_path_factory.mktemp("text") / "s", vision=False)


@pytest.fixture(scope="module")
def vlm_store(tmp_path_factory):
  return build_store(tmp_path_factory.mktemp("vlm") / "s", vision=True)


@pytest.mark.parametrize("kind", ["text", "encode_once"])
def test_a_whole_step_makes_no_device_to_host_transfer(kind, text_store, vlm_store):
  store, mbs = vlm_store if kind == "encode_once" else text_store
  trainer, planner = make_trainer(store, vision=kind != "text",
                                     encode_once=kind == "encode_once")
  works = [planner(mb) for mb in mbs]
  trainer.step(works[0]).fetch()  # compiles (compilation may read back constants)
  with no_device_to_host():
    with pytest.raises(AssertionError, match="Disallowed device-to-host transfer"):
      jax.device_get(trainer.state.version)  # the guard is on
    trainer.prefetch(works[1])
    result = trainer.step(works[1])
    trainer.prefetch(works[2])
    result2 = trainer.step(works[2])
  sums, grad_norm = result.fetch()
  assert trainer.version == 3 and result2.version == 3
  assert sums["tokens"] == works[1].total_tokens and np.isfinite(grad_norm) and grad_norm > 0
  trainer.close()


def test_the_next_mini_batch_is_read_before_its_step_is_called(text_store):
  store, mbs = text_store
  trainer, planner = make_trainer(store)
  w0, w1 = planner(mbs[0]), planner(mbs[1])
  trainer.prefetch(w0)
  trainer.prefetch(w1)
  trainer.step(w0)
  # w1 was fed before w0 trained: its first micro-batch is read (and on the devices)
  # before step(w1) asks for it; a reader started per mini-batch could not.
  deadline = time.time() + 30
  while not trainer.stream.ready() and time.time() < deadline:
    time.sleep(0.01)
  assert trainer.stream.ready()
  taken = trainer.stream.stats.taken
  trainer.step(w1)
  assert trainer.stream.stats.taken == taken + w1.num_micro_batches
  with pytest.raises(RuntimeError, match=r"step \(2, 0\) was not prefetched"):
    trainer.pending((2, 0))
  trainer.close()


@pytest.mark.parametrize("kind", ["text", "encode_once"])
def test_centralized_and_on_demand_give_the_same_gradient(kind, text_store, vlm_store):
  store, mbs = vlm_store if kind == "encode_once" else text_store
  vision = kind != "text"
  grads = []
  for centralized in (False, True):
    trainer, planner = make_trainer(store, vision=vision, encode_once=vision,
                                       centralized=centralized)
    grads.append(jax.device_get(trainer.step(planner(mbs[0]), apply=False).grads))
    assert trainer.version == 0  # apply=False: the state did not move
    trainer.close()
  for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_encode_once_through_the_trainer_equals_the_naive_step(vlm_store):
  store, mbs = vlm_store
  out = []
  for encode_once in (False, True):
    trainer, planner = make_trainer(store, vision=True, encode_once=encode_once)
    result = trainer.step(planner(mbs[1]), apply=False)
    out.append((jax.device_get(result.grads), result.fetch()[0]))
    trainer.close()
  (naive, s_naive), (dedup, s_dedup) = out
  scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(naive))
  assert scale > 0
  for a, b in zip(jax.tree.leaves(naive), jax.tree.leaves(dedup)):
    np.testing.assert_allclose(b, a, atol=2e-5 * scale)
  assert s_naive["tokens"] == s_dedup["tokens"]
  np.testing.assert_allclose(s_dedup["loss"], s_naive["loss"], rtol=1e-5)


def test_encode_once_quarantines_a_damaged_image_chunk(tmp_path):
  """w1's image data chunk deleted: its unit is quarantined, rows that use its images
  do not train (their loss tokens are missing from the step's sums), the rest do."""
  store, mbs = build_store(tmp_path / "s", vision=True, mini_batches=1)
  os.remove(tmp_path / "s" / "w1" / "images" / "data" / "c" / "0")
  fresh = TrajectoryStore.open(store.url)
  q = QuarantiningReader(fresh)
  trainer, planner = make_trainer(fresh, vision=True, encode_once=True, quarantine=q)
  work = planner(mbs[0])
  sums, grad_norm = trainer.step(work).fetch()
  lost = [m for grp in mbs[0].groups for m in grp.metas if m.unit == "w1"]
  assert lost and set(q.quarantined) == {"w1"}
  assert sums["tokens"] == work.total_tokens - sum(m.response_len for m in lost)
  assert {m.id for m in lost} <= set(q.bad_rows) and np.isfinite(grad_norm)
  trainer.close()
  assert not trainer.stream._thread.is_alive()
