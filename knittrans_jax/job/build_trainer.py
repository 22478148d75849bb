"""`make_trainer`: one trainer process's Trainer (job/trainer.py), built from the run's
set-up (job/setup.py), restored from its last checkpoint on resume.

A local run calls it once (job/local.py); on Ray every trainer actor calls it as
process p of jax.distributed (cluster/trainer_actors.py); job/replay.py calls it to
re-train another run's store.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from knittrans_jax.dataplane.centralized import local_driver
from knittrans_jax.job.metrics import StepFlops
from knittrans_jax.job.setup import JobSetup, checkpoint_dir, pack_layout
from knittrans_jax.job.trainer import BatchLayout, Centralized, OnDemand, Trainer
from knittrans_jax.models.flops import matmul_params, peak_flops
from knittrans_jax.rollout.weights import WeightPublisher
from knittrans_jax.storage import TrajectoryStore
from knittrans_jax.storage.quarantine import QuarantiningReader
from knittrans_jax.mesh import logical_sharding, make_mesh
from knittrans_jax.train import (Checkpointer, StepFunctions, abstract_state, init_train_state,
                                 make_optimizer)
from knittrans_jax.train.batch import rows_multiple as mesh_rows_multiple


@dataclasses.dataclass(frozen=True)
class BuiltTrainer:
  trainer: Trainer
  progress: dict | None  # the controller's state saved with the restored checkpoint
  rows_multiple: int  # the mesh's batch shards (all processes)
  mesh: jax.sharding.Mesh
  graphdef: nnx.GraphDef


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a trainer process sits: process `process` of `processes`, training
  `consumers // processes` of the plan's `consumers`; `host` as rollout workers name
  theirs in the store (locality)."""
  process: int
  processes: int
  consumers: int
  host: str


def make_model_fn(setup: JobSetup):
  return lambda rngs: setup.suite.make_model(setup.model, rngs)


def step_flops(setup: JobSetup, devices: int, device_kind: str | None) -> StepFlops | None:
  """The step's model FLOPs counter for a decoder policy (None for a VLM: the formula
  counts a decoder); `device_kind` None: no MFU (the trainers' devices unknown here)."""
  if not setup.suite.decoder_only:
    return None
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: make_model_fn(setup)(nnx.Rngs(0)))
  total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  peak = (peak_flops(device_kind) if device_kind is not None else
          {"value": None, "source": None, "reason": "the trainers' devices are not this process's"})
  return StepFlops(setup.model, matmul_params(setup.model, total), peak, devices)


def make_trainer(setup: JobSetup, workdir: str, store: TrajectoryStore, where: Placement,
                 resume: bool) -> BuiltTrainer:
  cfg, suite = setup.cfg, setup.suite
  model_fn = make_model_fn(setup)
  suite.check_step(setup, model_fn)
  ckpt = Checkpointer(checkpoint_dir(workdir), setup.checkpoint)
  mesh, rules = make_mesh(setup.mesh), setup.mesh.rules
  tx = make_optimizer(setup.optimizer)
  params = None
  if cfg.checkpoint and not (resume and ckpt.latest_step() is not None):
    m = setup.model
    model, _ = suite.load()(cfg.checkpoint, m.dtype, mesh=mesh, rules=rules, param_dtype=m.param_dtype,
                    remat=m.remat, attention=m.attention)
    params = nnx.state(model, nnx.Param)
  graphdef, state, shardings = init_train_state(model_fn, tx, mesh, rules, cfg.seed, params=params)
  fns = StepFunctions(graphdef, shardings, tx, setup.loss, mesh, rules, forward=suite.forward())
  # The KL term's reference: a frozen copy of the initial (or loaded) weights, taken
  # before any checkpoint is restored, so a resumed run keeps the same reference.
  reference = jax.tree.map(jnp.copy, state.params) if fns.needs_reference else None
  rows_multiple = mesh_rows_multiple(mesh, rules)
  if cfg.micro_batch_size % rows_multiple:
    raise ValueError(f"JobConfig.micro_batch_size = {cfg.micro_batch_size} does not split over "
                     f"the mesh's {rows_multiple} batch shards")
  if where.processes > 1:
    _check_rows_per_process(mesh, rules, rows_multiple, where)
  progress = None
  if resume:
    restored = ckpt.restore(abstract_state(state, shardings))
    if restored is None:
      print(f"--resume: no checkpoint in {ckpt.directory}; starting fresh")
    else:
      state, progress = restored
  P, p = where.processes, where.process
  per_process = where.consumers // P
  version = int(jax.device_get(state.version))  # once; the trainer counts on the host
  packed_rows = ()
  if cfg.packing:  # the plan's per-consumer row counts, for this process's consumers
    shapes = pack_layout(cfg, where.consumers, rows_multiple, suite.prefix_tokens).shapes()
    packed_rows = tuple(r * per_process for r in shapes)
  layout = BatchLayout(rows=cfg.micro_batch_size // P, seq_len=cfg.seq_len,
                       vocab_size=setup.model.vocab_size, rows_multiple=rows_multiple // P,
                       packed_rows=packed_rows)
  # The suite's batch fields and, for encode-once, its mini-batch step.
  fields, shared_step = suite.train_parts(fns, layout, setup)
  # Shared memory when the host has room for the versions (rollout/weights.py).
  sync = setup.weights.resolve(cfg.cluster, setup.weights.wire_bytes(state.params, setup.model))
  # A damaged unit is quarantined, not fatal: its readable rows and every other
  # unit still train; skipped rows show as tokens_skipped in metrics.jsonl.
  quarantine = QuarantiningReader(store)
  data = (OnDemand(store, cfg.prefetch_depth, read=quarantine.read,
                   unit_host=functools.lru_cache(maxsize=None)(store.unit_host), host=where.host)
          if cfg.data_path == "ondemand" else Centralized(local_driver(store)))
  trainer = Trainer(
      fns, state, data, layout, range(p * per_process, (p + 1) * per_process),
      fields=fields, shared_step=shared_step, version=version, quarantine=quarantine, checkpointer=ckpt,
      publisher=WeightPublisher(workdir, process=p, version=version, sync=sync,
                                dtype=setup.weights.wire_dtype(setup.model)),
      process=p, processes=P, reference=reference)
  return BuiltTrainer(trainer, progress, rows_multiple, mesh, graphdef)


def _check_rows_per_process(mesh, rules, B: int, where: Placement) -> None:
  """Process p's local rows must be the p-th contiguous block of every global batch
  (each process passes only its rows; slot and row numbering rely on the order)."""
  P, p = where.processes, where.process
  sharding = logical_sharding(mesh, rules, "batch")
  blocks = {(i[0].start or 0, B if i[0].stop is None else i[0].stop)
            for i in sharding.addressable_devices_indices_map((B,)).values()}
  if (B % P or min(blocks)[0] != p * B // P or max(b for _, b in blocks) != (p + 1) * B // P
      or sum(b - a for a, b in blocks) != B // P):
    raise ValueError(f"process {p} of {P} holds batch rows {sorted(blocks)} of every {B}: the "
                     "mesh must split 'batch' over the processes in process order "
                     "(MeshConfig.axes / rules)")
