"""The training job: wires the roles and runs the one train loop.

One trajectory's journey: a rollout worker generates it and appends it to its
storage unit (rollout/worker.py) and reports metadata; the controller
(job/controller.py) feeds the group to admission (admission/) and plans the
admitted mini-batch (job/work.py, dataplane/); every trainer process reads its
share from the store, one micro-batch ahead, and steps (job/trainer.py, train/).
Weights go back to the workers through the work dir (rollout/weights.py).

    set-up  Job(workdir, resume): configs checked, a Trainer in every process,
            the controller, the rollout pool and the metrics log in process 0
    loop    Job.run(): dispatch, poll, admit -> step; the next mini-batch is
            admitted and read while the current one computes; then the step's
            metrics come back (its one host sync), its groups retire, weights are
            published and, when due, a checkpoint is written.

Where the roles run (JobConfig.cluster): 'local', this process is the controller and
the trainer, rollout workers are its child processes (job/workers.py); 'ray', this
process (the driver) is the controller, trainers and rollout workers are Ray actors
(cluster/: one trainer actor per host under jax.distributed, each building its
Trainer with this same class, role 'trainer').
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import functools
import signal
import socket
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from knittrans_jax import gin_cli
from knittrans_jax.admission import make_policy
from knittrans_jax.admission.dispatch import make_dispatch
from knittrans_jax.cluster.ray_setup import RayConfig  # noqa: F401  (gin: no Ray imported)
from knittrans_jax.dataplane.centralized import local_driver
from knittrans_jax.job.config import JobConfig
from knittrans_jax.job.controller import Controller, JobStalled
from knittrans_jax.job.evaluation import EvalConfig, Evaluator
from knittrans_jax.job.metrics import MetricsLog
from knittrans_jax.job.progress import ControllerState
from knittrans_jax.job.trainer import BatchLayout, Centralized, OnDemand, Trainer
from knittrans_jax.job.trainer_group import LocalTrainer
from knittrans_jax.job.work import StepPlanner, encode_once_slots
from knittrans_jax.job.workers import ColocatedPool, WorkerPool
from knittrans_jax.models import DecoderConfig, ViTConfig, hf, qwen_vl
from knittrans_jax.models.vision_spec import VisionSpec
from knittrans_jax.models.vlm import make_model
from knittrans_jax.multimodal import (EncodeOnceConfig, EncodeOnceStep, PrefixImages,
                                      QwenVLImages, check_deterministic, naive_qwen_forward,
                                      naive_vlm_forward)
from knittrans_jax.rl import LossConfig
from knittrans_jax.rollout import tasks
from knittrans_jax.rollout.groups import (MathSource, rollout_groups, suite_prompt_len,
                                         suite_sources)
from knittrans_jax.rollout.math_tasks import MathTaskConfig
from knittrans_jax.rollout.qwen_vision_tasks import QwenVisionTaskConfig, QwenVisionTasks
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.rollout.weights import WeightPublisher
from knittrans_jax.storage import StoreSchema, TrajectoryStore
from knittrans_jax.storage.quarantine import QuarantiningReader
from knittrans_jax.train import (CheckpointConfig, Checkpointer, MeshConfig, OptimizerConfig,
                                 StepFunctions, abstract_state, init_train_state, make_mesh,
                                 make_optimizer)
from knittrans_jax.train.batch import rows_multiple
from knittrans_jax.train.mesh import logical_sharding
from knittrans_jax.train.step import text_forward


def model_config(cfg: JobConfig) -> DecoderConfig:
  """The policy's config: gin's DecoderConfig, or with JobConfig.checkpoint its
  config.json's architecture under gin's dtype, param_dtype, remat and attention."""
  d = DecoderConfig()
  if not cfg.checkpoint:
    return d
  kw = dict(dtype=d.dtype, param_dtype=d.param_dtype, remat=d.remat, attention=d.attention)
  if cfg.suite == "vision":  # a Qwen-VL checkpoint (JobConfig checked): its language model
    return qwen_vl.config_from_hf(hf.read_config(cfg.checkpoint), **kw).text
  return hf.config_from_hf(hf.read_config(cfg.checkpoint), **kw)


def vision_spec(cfg: JobConfig) -> VisionSpec | None:
  """The policy's vision path (models/vision_spec.py): None for text, JobConfig.checkpoint's
  Qwen-VL model under gin's dtype, param_dtype, remat and attention, or the tiny VLM."""
  if cfg.suite != "vision":
    return None
  if not cfg.checkpoint:
    return VisionSpec.tiny(ViTConfig())
  d = DecoderConfig()
  return VisionSpec.from_qwen_checkpoint(
      cfg.checkpoint, QwenVisionTaskConfig().image_size, dtype=d.dtype, param_dtype=d.param_dtype,
      remat=d.remat, attention=d.attention)


ROLES = ("local", "driver", "trainer")


class Job:

  def __init__(self, workdir: str, resume: bool = False, store_url: str | None = None,
               consumers: int | None = None, role: str = "local", ray_cfg=None,
               host: str | None = None):
    """`store_url` / `consumers` override JobConfig's (job/replay.py trains another
    run's store, planned over that run's consumers).

    role: 'local' (the controller and the trainer in this process), 'driver' (the
    controller; trainer actors on Ray, RayConfig `ray_cfg`) or 'trainer' (a Ray
    trainer actor, process p of jax.distributed: the trainer only). host: this
    process's host as the rollout workers name theirs in the store (a Ray node's
    address; by default the hostname, what a local worker registers)."""
    if role not in ROLES:
      raise ValueError(f"role = {role!r}: use one of {ROLES}")
    self.workdir = os.path.abspath(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    self.cfg = cfg = JobConfig()
    self.role = role
    self.host = host or socket.gethostname()
    if role == "driver":
      self.process, self.processes = 0, ray_cfg.trainers
    else:
      self.process, self.processes = jax.process_index(), jax.process_count()
    if role == "local" and self.processes > 1:
      raise ValueError(f"{self.processes} JAX processes: several trainer processes run as Ray "
                       "actors (JobConfig.cluster = 'ray', RayConfig.trainers; "
                       "docs/distributed.md)")
    self.controller_process = role != "trainer"
    self.consumers = consumers or cfg.consumers or self.processes
    self._check_processes()
    self.model_cfg, self.sampler_cfg, self.loss_cfg = model_config(cfg), SamplerConfig(), LossConfig()
    self.vision = cfg.suite == "vision"
    # One spec of the vision path: the model, the batch layout, workers and the
    # colocated sampler all get it.
    self.vision_spec = vision_spec(cfg)
    self.qwen = QwenVisionTasks.of(self.vision_spec)
    self.math = None
    if cfg.suite == "math":
      mcfg = MathTaskConfig()
      tok_dir = mcfg.tokenizer or cfg.checkpoint
      if tok_dir is None:
        raise ValueError("JobConfig.suite = 'math' needs a tokenizer: set JobConfig.checkpoint "
                         "or MathTaskConfig.tokenizer")
      self.math = MathSource(mcfg, tok_dir, cfg.seed)
      # The checkpoint's EOS and stop tokens end each response.
      self.sampler_cfg = dataclasses.replace(
          self.sampler_cfg, stop_tokens=self.math.suite().tokenizer.stop_ids)
    self.sources = suite_sources(cfg.suite, self.math)
    self.prompt_len = (self.qwen.prompt_len if self.qwen is not None
                       else suite_prompt_len(cfg.suite, self.math))
    # The sources the job trains on: the quota's, or the whole suite without one.
    quota = cfg.spec.source_quota
    self.trained_sources = tuple(quota) if quota else self.sources
    self._check_model_and_tasks()
    self.engine_options = None
    if cfg.engine == "vllm":
      from knittrans_jax.rollout import vllm_engine
      vllm_engine.check_available()  # before any process starts: what to install
      vllm_engine.check_model(self.model_cfg)
      opts = vllm_engine.VllmOptions()
      self.engine_options = dataclasses.replace(
          opts, max_model_len=opts.max_model_len or self.prompt_len + self.sampler_cfg.max_new_tokens)
    self.ckpt = Checkpointer(os.path.join(self.workdir, "checkpoints"), CheckpointConfig())
    if role != "trainer" and not resume and (self.ckpt.latest_step() is not None
                                             or os.path.exists(os.path.join(self.workdir, "store"))):
      raise ValueError(f"{self.workdir} holds a previous run: pass --resume to continue it, "
                       "--overwrite to start over, or another --workdir")
    self.store_url = store_url or cfg.store_url or "file://" + os.path.join(self.workdir, "store")
    # A store elsewhere (s3://, gs://) outlives the work dir and --overwrite: a new run
    # must not write into a previous run's units.
    if (role != "trainer" and not resume and store_url is None and cfg.store_url
        and TrajectoryStore.exists(cfg.store_url)):
      raise ValueError(f"JobConfig.store_url = {cfg.store_url!r} holds a previous run's store: "
                       "pass --resume to continue that run, or point JobConfig.store_url at a "
                       "new location")
    if self.controller_process:  # the trainers open it (Ray: once the driver made it)
      self.store = TrajectoryStore.create(self.store_url, StoreSchema(
          sources=self.sources, max_prompt_len=self.prompt_len,
          max_response_len=self.sampler_cfg.max_new_tokens))
    else:
      self.store = TrajectoryStore.open(self.store_url)
    # A unit's host as its writer registered it, looked up once per unit.
    self.unit_host = functools.lru_cache(maxsize=None)(self.store.unit_host)
    self.log, self.evaluator = None, None
    if role == "driver":
      if cfg.mode == "colocated":
        raise ValueError("JobConfig.mode = 'colocated' with JobConfig.cluster = 'ray': the "
                         "colocated reference generates in the trainer's process; run it "
                         "locally (mode 'synchronous' is its schedule on Ray's workers)")
      from knittrans_jax.cluster.trainer_actors import RayTrainerGroup
      import gin
      self.trainers = RayTrainerGroup(ray_cfg, self.workdir, resume, self.store_url,
                                      self.consumers, gin.config_str())
      self.rows_multiple, progress = self.trainers.rows_multiple, self.trainers.progress
      encode_once = self.trainers.encode_once
    else:
      self.trainer, progress = self._build_trainer(resume)
      self.restored_progress = progress
      self.trainers = LocalTrainer(self.trainer, self.workdir, self.host)
      encode_once = self.trainer.encode_once is not None
    if self.controller_process:
      spec = cfg.spec
      self.planner = StepPlanner(
          self.consumers, cfg.micro_batch_size, self.loss_cfg.normalize_adv_std,
          image_slots=(encode_once_slots(self.rows_multiple, self.consumers,
                                         spec.mini_batch_groups)
                       if encode_once else None),
          consumer_host=self.trainers.consumer_host, unit_host=self.unit_host,
          locality_tolerance=cfg.locality_tolerance)
      self.progress = ControllerState.from_json(progress) if progress else ControllerState()
      policy = make_policy(cfg.policy if cfg.mode == "disaggregated" else "train_batch", spec)
      # Prompt sources in quota-exact blocks of G, ordered by the dispatch policy.
      self.stream = make_dispatch(cfg.dispatch, spec, self.sources,
                                  np.random.default_rng(cfg.seed))
      self.policy = policy
      self.log = MetricsLog(self.workdir, spec, resume=resume, upto_step=self.trainers.version)
      eval_cfg = EvalConfig()
      self.evaluator = None
      if eval_cfg.every_steps:
        if self.qwen is not None:
          raise ValueError("EvalConfig.every_steps: held-out evaluation of a Qwen-VL policy is "
                           "not built yet; set it to 0")
        if role == "driver":
          raise ValueError("EvalConfig.every_steps: held-out evaluation runs in a local "
                           "run's trainer process for now (JobConfig.cluster = 'local'); set "
                           "it to 0 on Ray")
        self.evaluator = Evaluator(
            eval_cfg, self.graphdef, self.sampler_cfg, cfg.suite, self.trained_sources, cfg.seed,
            self.vision_spec, self.math)
    # As t5x does: the operative config right after set-up, so a crashed run has it.
    if self.controller_process:
      gin_cli.save_operative_config(self.workdir)

  # -- set-up ---------------------------------------------------------------------------
  def _check_processes(self) -> None:
    cfg, P = self.cfg, self.processes
    if P > 1 and (cfg.mode != "disaggregated" or cfg.data_path != "ondemand"):
      raise ValueError(f"{P} trainer processes need JobConfig.mode = 'disaggregated' "
                       f"and data_path = 'ondemand' (got {cfg.mode!r}, {cfg.data_path!r}); the "
                       "colocated reference and the centralized baseline run in one process")
    if self.consumers % P or cfg.micro_batch_size % self.consumers:
      raise ValueError(f"JobConfig.consumers = {self.consumers} must be a multiple of the "
                       f"{P} trainer processes and divide micro_batch_size = "
                       f"{cfg.micro_batch_size}")

  def _check_model_and_tasks(self) -> None:
    cfg, prompt_len = self.cfg, self.prompt_len
    vocab = self.math.suite().tokenizer.vocab_size if self.math else tasks.VOCAB_SIZE
    if self.model_cfg.vocab_size < vocab:
      raise ValueError(f"DecoderConfig.vocab_size = {self.model_cfg.vocab_size} < the tasks' "
                       f"vocabulary {vocab}")
    if self.math:
      self.math.suite().check_lengths()  # an over-long prompt is an error now, not mid-run
    if cfg.seq_len < prompt_len + self.sampler_cfg.max_new_tokens:
      raise ValueError(f"JobConfig.seq_len = {cfg.seq_len} < prompt {prompt_len} + "
                       f"max_new_tokens {self.sampler_cfg.max_new_tokens}")
    unknown = set(cfg.spec.source_quota or {}) - set(self.sources)
    if unknown:
      raise ValueError(f"TrainBatchSpec.source_quota names unknown sources {sorted(unknown)}; "
                       f"the {cfg.suite} tasks are {self.sources}")
    # The loss recomputes log-probs of logits / LossConfig.temperature; the behaviour
    # log-probs came from the sampler's: different temperatures bias every ratio.
    if self.loss_cfg.temperature != self.sampler_cfg.temperature:
      raise ValueError(f"LossConfig.temperature = {self.loss_cfg.temperature} differs from "
                       f"SamplerConfig.temperature = {self.sampler_cfg.temperature}: the "
                       "importance ratio would compare log-probs at two temperatures; set both "
                       "to the same value")

  def _model_fn(self, rngs):
    return make_model(self.model_cfg, self.vision_spec, rngs)

  def _build_trainer(self, resume: bool) -> tuple[Trainer, dict | None]:
    cfg = self.cfg
    encode_once = self.vision and cfg.encode_once
    qwen = self.qwen
    path = QwenVLImages(qwen.model.vision.merge) if qwen is not None else PrefixImages()
    if encode_once:  # refuses dropout with the reason (encoding once would change it)
      with nnx.use_eager_sharding(False):
        check_deterministic(nnx.eval_shape(lambda: self._model_fn(nnx.Rngs(0))),
                            path.encoder_keys)
    elif self.vision and qwen is None and self.vision_spec.vit.dropout:
      raise ValueError(f"ViTConfig.dropout = {self.vision_spec.vit.dropout}: the trainer keeps no "
                       "dropout rng state; set it to 0")
    mesh_cfg = MeshConfig()
    self.mesh, self.rules = make_mesh(mesh_cfg), mesh_cfg.rules
    tx = make_optimizer(OptimizerConfig().for_steps(cfg.train_batches * cfg.spec.num_mini_batches))
    params = None
    if cfg.checkpoint and not (resume and self.ckpt.latest_step() is not None):
      m = self.model_cfg
      load = qwen_vl.load if qwen is not None else hf.load
      model, _ = load(cfg.checkpoint, m.dtype, mesh=self.mesh, rules=self.rules,
                      param_dtype=m.param_dtype, remat=m.remat, attention=m.attention)
      params = nnx.state(model, nnx.Param)
    graphdef, state, shardings = init_train_state(self._model_fn, tx, self.mesh, self.rules,
                                                  cfg.seed, params=params)
    self.graphdef = graphdef
    forward = (naive_qwen_forward(qwen.grid) if qwen is not None
               else naive_vlm_forward() if self.vision else text_forward)
    fns = StepFunctions(graphdef, shardings, tx, self.loss_cfg, self.mesh, self.rules,
                        forward=forward)
    # The KL term's reference: a frozen copy of the initial (or loaded) weights, taken
    # before any checkpoint is restored, so a resumed run keeps the same reference.
    reference = jax.tree.map(jnp.copy, state.params) if fns.needs_reference else None
    self.rows_multiple = rows_multiple(self.mesh, self.rules)
    if cfg.micro_batch_size % self.rows_multiple:
      raise ValueError(f"JobConfig.micro_batch_size = {cfg.micro_batch_size} does not split over "
                       f"the mesh's {self.rows_multiple} batch shards")
    if self.processes > 1:
      self._check_rows_per_process()
    progress = None
    if resume:
      restored = self.ckpt.restore(abstract_state(state, shardings))
      if restored is None:
        print(f"--resume: no checkpoint in {self.ckpt.directory}; starting fresh")
      else:
        state, progress = restored
    per_process = self.consumers // self.processes
    version = int(jax.device_get(state.version))  # once; the trainer counts on the host
    layout = BatchLayout(rows=cfg.micro_batch_size // self.processes, seq_len=cfg.seq_len,
                         vocab_size=self.model_cfg.vocab_size,
                         rows_multiple=self.rows_multiple // self.processes,
                         vision=self.vision_spec)
    # A damaged unit is quarantined, not fatal: its readable rows and every other
    # unit still train; skipped rows show as tokens_skipped in metrics.jsonl.
    self.quarantine = QuarantiningReader(self.store)
    data = (OnDemand(self.store, cfg.prefetch_depth, read=self.quarantine.read,
                     unit_host=self.unit_host, host=self.host)
            if cfg.data_path == "ondemand" else Centralized(local_driver(self.store)))
    trainer = Trainer(
        fns, state, data, layout, range(self.process * per_process, (self.process + 1) * per_process),
        encode_once=EncodeOnceStep(fns, EncodeOnceConfig(), path=path) if encode_once else None,
        vision=self.vision, version=version, quarantine=self.quarantine, checkpointer=self.ckpt,
        publisher=WeightPublisher(self.workdir, process=self.process, version=version),
        process=self.process, processes=self.processes, reference=reference)
    return trainer, progress

  def _check_rows_per_process(self) -> None:
    """Process p's local rows must be the p-th contiguous block of every global batch
    (each process passes only its rows; slot and row numbering rely on the order)."""
    B, P, p = self.rows_multiple, self.processes, self.process
    sharding = logical_sharding(self.mesh, self.rules, "batch")
    blocks = {(i[0].start or 0, B if i[0].stop is None else i[0].stop)
              for i in sharding.addressable_devices_indices_map((B,)).values()}
    if (B % P or min(blocks)[0] != p * B // P or max(b for _, b in blocks) != (p + 1) * B // P
        or sum(b - a for a, b in blocks) != B // P):
      raise ValueError(f"process {p} of {P} holds batch rows {sorted(blocks)} of every {B}: the "
                       "mesh must split 'batch' over the processes in process order "
                       "(MeshConfig.axes / rules)")

  def _pool(self):
    cfg = self.cfg
    worker_args = dict(seed=cfg.seed, n=cfg.spec.group_size, model_config=self.model_cfg,
                       sampler_config=self.sampler_cfg, suite=cfg.suite, vision=self.vision_spec,
                       math=self.math, groups_per_call=cfg.groups_per_call, engine=cfg.engine,
                       engine_options=self.engine_options)
    if self.role == "driver":
      from knittrans_jax.cluster.rollout_actors import RayWorkerPool
      estimate = getattr(self.stream, "estimate", lambda source: None)
      return RayWorkerPool(self.workdir, self.store, self.store_url, workers=cfg.workers,
                           worker_args=worker_args, cfg=self.trainers.cfg, estimate=estimate)
    if cfg.mode == "colocated":
      generate = lambda requests: rollout_groups(  # noqa: E731  (the current weights)
          self.graphdef, self.trainer.state.params, self.trainer.version, cfg.seed, requests,
          cfg.spec.group_size, self.sampler_cfg, cfg.suite, self.math, self.vision_spec)
      return ColocatedPool(generate, self.store.writer("colocated"))
    return WorkerPool(self.workdir, self.store_url, workers=cfg.workers, worker_args=worker_args,
                      store=self.store)

  # -- the loop ---------------------------------------------------------------------------
  def run(self) -> dict:
    """(process 0) Trains to JobConfig.train_batches; returns the summary."""
    cfg, trainers = self.cfg, self.trainers
    t0 = time.perf_counter()
    target = cfg.train_batches * cfg.spec.num_mini_batches
    self.bar = tqdm(total=target, initial=min(trainers.version, target), desc=cfg.mode,
                    unit="step", dynamic_ncols=True, mininterval=0.5)
    # Ctrl-C only sets a flag: the loop stops at the next step boundary, so a step is
    # never half recorded (state advanced but its groups not retired).
    self.stop_requested = False

    def on_sigint(signum, frame):
      self.stop_requested = True
    previous = signal.signal(signal.SIGINT, on_sigint)
    completed = False
    pool = None
    try:
      pool = self._pool()
      self.controller = Controller(cfg.spec, self.policy, self.stream, pool, self.progress,
                                   window=cfg.groups_in_flight, colocated=cfg.mode != "disaggregated",
                                   stall_timeout_s=cfg.stall_timeout_s)
      self.controller.resume(self.store.units(),
                             lambda unit, start: self.store.reader(unit).list(start=start))
      if cfg.mode != "colocated":
        trainers.publish()  # the workers' first weights
      self._loop(target)
      if self.stop_requested:
        print("\ninterrupted: saving a checkpoint; resume with --resume")
      completed = True
    finally:
      signal.signal(signal.SIGINT, previous)
      self.bar.close()
      if pool is not None:
        pool.close()
      error = sys.exc_info()[1]
      stalled = isinstance(error, JobStalled)  # raised between steps
      lost = type(error).__name__ == "TrainerLost"  # Ray: the group is rebuilt (cluster/)
      try:
        if not lost and (completed or stalled or self.processes == 1):
          try:
            if hasattr(self, "controller"):
              trainers.save(self.controller.progress(), force=True)
          finally:
            trainers.finish()
        else:
          # A failure may have come mid-step, with the others inside a collective: no
          # collective checkpoint now (the last periodic one stands); tell them to stop.
          trainers.abort(repr(error))
      finally:
        self.log.close()
    summary = self.log.summary(wall_s=time.perf_counter() - t0,
                               exposed_data_wait_s=trainers.exposed_wait_s,
                               raw_transfer_s=trainers.raw_transfer_s, mode=cfg.mode,
                               policy=self.policy.name, groups=dict(self.progress.retired),
                               worker_restarts=getattr(pool, "restarts", 0),
                               dispatch=cfg.dispatch, dispatch_estimates_s={
                                   src: getattr(self.stream, "estimate", lambda _: None)(src)
                                   for src in self.trained_sources})
    if self.evaluator is not None:
      summary["eval_train_overlap"] = self.evaluator.train_overlap(range(self.progress.next_group))
    with open(os.path.join(self.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    gin_cli.save_operative_config(self.workdir)
    return summary

  def _loop(self, target: int) -> None:
    ctl, trainers = self.controller, self.trainers
    ahead: collections.deque = collections.deque()  # (mini-batch, work) admitted, being read

    def admit():
      if not ahead and (mb := ctl.admit(trainers.version)) is not None:
        work = self.planner(mb)
        trainers.prefetch(work)  # every trainer starts reading it now
        ahead.append((mb, work))

    ev = self.evaluator
    if ev is not None and ev.config.at_start and trainers.version == 0:
      t_eval = time.perf_counter()  # the initial policy: where the curve starts
      self.log.start_eval(ev(self.trainer.state.params, 0), time.perf_counter() - t_eval)
    while trainers.version < target and not self.stop_requested:
      ctl.dispatch()
      ctl.poll(timeout=0.0 if ahead else 0.05)  # block briefly only with nothing to train
      admit()
      if not ahead:
        ctl.check_stall()
        continue
      mb, work = ahead.popleft()
      v_consume = trainers.version
      result = trainers.step(work)  # applied on dispatch; the devices compute on
      failure = None
      if trainers.version < target:  # admit and read the next one meanwhile
        try:
          ctl.dispatch()
          ctl.poll(timeout=0.0)
          admit()
        except Exception as e:  # noqa: BLE001  (re-raised once this step is recorded)
          failure = e
      # Record the step before anything else can fail: its update is applied, so a
      # checkpoint written now must count its groups as trained.
      sums, grad_norm = result.fetch()  # the step's one host round trip
      ctl.trained(mb)
      metas = [m for grp in mb.groups for m in grp.metas]
      evaluation, t_eval = None, time.perf_counter()
      if self.evaluator is not None and self.evaluator.due(trainers.version, target):
        evaluation = self.evaluator(self.trainer.state.params, trainers.version)
      self.log.step(mb, metas, v_consume, sums, grad_norm, admitted_tokens=work.total_tokens,
                    evaluation=evaluation, eval_s=time.perf_counter() - t_eval,
                    local_fraction=work.local_fraction)
      self.bar.update(1)
      self.bar.set_postfix(self.log.postfix(), refresh=False)
      if failure is not None:
        raise failure
      if self.cfg.mode != "colocated":
        trainers.publish()  # synchronous: before the next train batch is dispatched
      if trainers.save_due():
        trainers.save(ctl.progress())


def run(workdir: str, resume: bool = False) -> dict:
  """Runs the job where JobConfig.cluster says; returns the summary."""
  if JobConfig().cluster == "ray":
    from knittrans_jax.cluster.ray_job import run_on_ray
    return run_on_ray(workdir, resume)
  return Job(workdir, resume).run()
