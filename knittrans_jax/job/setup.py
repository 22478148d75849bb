"""A run's set-up as pure functions of its config: what every role derives the same way.

    setup = job_setup(JobConfig())            # model, sampler, loss, tasks, checked together
    check_new_run(workdir, cfg, resume)       # refuses to write over a previous run
    store = create_store(setup, store_url(workdir, cfg))
    planner = make_planner(setup, trainers, unit_host)

The driver (job/driver.py), the local deployment (job/local.py), Ray's trainer actors
and driver (cluster/) and job/replay.py all build from these, so a rule checked here
holds on every deployment.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

import numpy as np

from knittrans_jax.admission import make_policy
from knittrans_jax.admission.dispatch import DispatchStream, make_dispatch
from knittrans_jax.dataplane.packing import PackLayout
from knittrans_jax.job.config import JobConfig
from knittrans_jax.job.evaluation import EvalConfig, Evaluator
from knittrans_jax.job.work import StepPlanner, image_slots
from knittrans_jax.mesh import MeshConfig
from knittrans_jax.models import DecoderConfig
from knittrans_jax.multimodal.encode_once import EncodeOnceConfig
from knittrans_jax.rl import LossConfig
from knittrans_jax import suites
from knittrans_jax.suites import TaskSuite
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.rollout.weights import WeightSyncConfig
from knittrans_jax.rollout.worker import WorkerArgs
from knittrans_jax.storage import StoreSchema, TrajectoryStore
from knittrans_jax.train import CheckpointConfig, Checkpointer
from knittrans_jax.train.optimizer import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class JobSetup:
  """What a run's config derives, once: the policy's model, sampler and loss, its
  tasks (sources, prompt length), every other part's config as gin binds it (built
  here and nowhere below: checkpoints, mesh, optimizer, evaluation, the encode-once
  step, weight sync) and, for vLLM, the engine options."""
  cfg: JobConfig
  model: DecoderConfig
  sampler: SamplerConfig
  loss: LossConfig
  suite: TaskSuite  # the task family (suites/): tasks, environments, model, batch fields
  sources: tuple[str, ...]  # the suite's
  trained_sources: tuple[str, ...]  # the quota's, or the whole suite without one
  prompt_len: int
  checkpoint: CheckpointConfig
  mesh: MeshConfig
  optimizer: OptimizerConfig  # total_steps set from the run's length
  evaluation: EvalConfig
  encode_once: EncodeOnceConfig
  weights: WeightSyncConfig  # how weights travel
  engine_options: object | None = None  # VllmOptions / VllmServerOptions (the vLLM engines)

  @property
  def max_sequence_len(self) -> int:
    """The longest trajectory (prompt and response; an episode's whole context)."""
    return self.suite.max_sequence_len(self.sampler)

  @property
  def synchronous(self) -> bool:
    """Each train batch dispatched only once the previous one is trained (modes
    'colocated' and 'synchronous': the colocated schedule)."""
    return self.cfg.mode != "disaggregated"


def job_setup(cfg: JobConfig) -> JobSetup:
  """Derives and checks the run's parts from `cfg` (and the gin config of each part)."""
  decoder = DecoderConfig()
  suite = suites.build(cfg, decoder)
  sampler = suite.sampler(SamplerConfig())  # a tokenizer's stop tokens end each response
  sources = suite.sources
  quota = cfg.spec.source_quota
  setup = JobSetup(
      cfg=cfg, model=suites.decoder_config(suite, cfg.checkpoint, decoder), sampler=sampler,
      loss=LossConfig(), suite=suite, sources=sources,
      trained_sources=tuple(quota) if quota else sources, prompt_len=suite.prompt_len,
      weights=WeightSyncConfig(), checkpoint=CheckpointConfig(), mesh=MeshConfig(),
      optimizer=OptimizerConfig().for_steps(cfg.train_batches * cfg.spec.num_mini_batches),
      evaluation=EvalConfig(), encode_once=EncodeOnceConfig())
  if setup.loss.aggregation == "constant" and not setup.loss.norm_len:  # Dr. GRPO's constant
    setup = dataclasses.replace(setup, loss=dataclasses.replace(
        setup.loss, norm_len=setup.max_sequence_len - setup.prompt_len))
  setup.weights.resolve(cfg.cluster)  # a transport the cluster cannot serve fails here
  _check_model_and_tasks(setup)
  if cfg.engine == "vllm":
    from knittrans_jax.rollout import vllm_engine  # vLLM only when asked for
    vllm_engine.check_available()  # before any process starts: what to install
    vllm_engine.check_model(setup.model)
    opts = vllm_engine.VllmOptions()
    setup = dataclasses.replace(setup, engine_options=dataclasses.replace(
        opts, max_model_len=opts.max_model_len or setup.max_sequence_len))
  if cfg.engine == "vllm_server":
    from knittrans_jax.rollout.vllm_server_engine import VllmServerOptions
    opts = VllmServerOptions()
    if len(opts.urls) < cfg.workers:
      raise ValueError(f"JobConfig.engine = 'vllm_server' with {cfg.workers} rollout workers: "
                       f"VllmServerOptions.urls names {len(opts.urls)} server(s) "
                       f"{list(opts.urls)}; each worker needs its own (docs/rollout.md)")
    setup = dataclasses.replace(setup, engine_options=dataclasses.replace(
        opts, max_model_len=opts.max_model_len or setup.max_sequence_len))
  return setup


def _check_model_and_tasks(s: JobSetup) -> None:
  cfg, vocab = s.cfg, s.suite.vocab_size
  if vocab is not None and s.model.vocab_size < vocab:
    raise ValueError(f"DecoderConfig.vocab_size = {s.model.vocab_size} < the tasks' "
                     f"vocabulary {vocab}")
  s.suite.check(s)
  if cfg.seq_len < s.max_sequence_len:
    raise ValueError(f"JobConfig.seq_len = {cfg.seq_len} < {s.suite.longest(s.sampler)}")
  if s.model.max_positions < s.max_sequence_len:
    raise ValueError(f"DecoderConfig.max_positions = {s.model.max_positions} < the longest "
                     f"trajectory, {s.max_sequence_len} tokens")
  unknown = set(cfg.spec.source_quota or {}) - set(s.sources)
  if unknown:
    raise ValueError(f"TrainBatchSpec.source_quota names unknown sources {sorted(unknown)}; "
                     f"the {cfg.suite} tasks are {s.sources}")
  # The loss recomputes log-probs of logits / LossConfig.temperature; the behaviour
  # log-probs came from the sampler's: different temperatures bias every ratio.
  longest = s.max_sequence_len - s.prompt_len
  if s.loss.overlong_buffer > longest:
    raise ValueError(f"LossConfig.overlong_buffer = {s.loss.overlong_buffer} exceeds the "
                     f"longest response, {longest} tokens")
  if s.loss.temperature != s.sampler.temperature:
    raise ValueError(f"LossConfig.temperature = {s.loss.temperature} differs from "
                     f"SamplerConfig.temperature = {s.sampler.temperature}: the "
                     "importance ratio would compare log-probs at two temperatures; set both "
                     "to the same value")


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(workdir, "checkpoints")


def store_url(workdir: str, cfg: JobConfig) -> str:
  return cfg.store_url or "file://" + os.path.join(workdir, "store")


def check_new_run(workdir: str, cfg: JobConfig, resume: bool) -> None:
  """A fresh run (no --resume) must not write into a previous run's work dir or store."""
  if resume:
    return
  ckpt = Checkpointer(checkpoint_dir(workdir))  # read only
  try:
    previous = ckpt.latest_step() is not None
  finally:
    ckpt.close()
  if previous or os.path.exists(os.path.join(workdir, "store")):
    raise ValueError(f"{workdir} holds a previous run: pass --resume to continue it, "
                     "--overwrite to start over, or another --workdir")
  # A store elsewhere (s3://, gs://) outlives the work dir and --overwrite.
  if cfg.store_url and TrajectoryStore.exists(cfg.store_url):
    raise ValueError(f"JobConfig.store_url = {cfg.store_url!r} holds a previous run's store: "
                     "pass --resume to continue that run, or point JobConfig.store_url at a "
                     "new location")


def create_store(setup: JobSetup, url: str) -> TrajectoryStore:
  """The run's store (the controller's process creates it; trainers open it)."""
  return TrajectoryStore.create(url, StoreSchema(
      sources=setup.sources, max_prompt_len=setup.prompt_len,
      max_response_len=setup.max_sequence_len - setup.prompt_len))


def worker_args(setup: JobSetup) -> WorkerArgs:
  cfg = setup.cfg
  return WorkerArgs(seed=cfg.seed, n=cfg.spec.group_size, model_config=setup.model,
                    sampler_config=setup.sampler, suite=setup.suite,
                    groups_per_call=cfg.groups_per_call, engine=cfg.engine,
                    engine_options=setup.engine_options, weights=setup.weights)


def make_planner(setup: JobSetup, consumers: int, trainers,
                 unit_host: Callable[[str], str] | None) -> StepPlanner:
  """Plans each admitted mini-batch over `consumers` (the trainers' handle gives the
  mesh's batch shards, whether the step shares an input per mini-batch (encode-once's
  image slots), each consumer's host)."""
  cfg = setup.cfg
  return StepPlanner(
      consumers, cfg.micro_batch_size, setup.loss.advantage,
      overlong=((setup.max_sequence_len - setup.prompt_len, setup.loss.overlong_buffer)
                if setup.loss.overlong_buffer else None),
      image_slots=(image_slots(trainers.rows_multiple, consumers, cfg.spec.mini_batch_groups)
                   if trainers.shared_images else None),
      consumer_host=trainers.consumer_host, unit_host=unit_host,
      locality_tolerance=cfg.locality_tolerance,
      pack=(pack_layout(cfg, consumers, trainers.rows_multiple, setup.suite.prefix_tokens)
            if cfg.packing else None))


def pack_layout(cfg, consumers: int, rows_multiple: int, prefix: int = 0) -> PackLayout:
  """Packed rows of seq_len tokens (plus the tiny VLM's image `prefix`, so a trajectory
  that fits a padded row fits a packed one), up to micro_batch_size rows a micro-batch
  over all consumers; a consumer's row count keeps the global one a multiple of the
  mesh's batch shards."""
  unit = rows_multiple // math.gcd(rows_multiple, consumers)
  max_rows = cfg.micro_batch_size // consumers
  if max_rows % unit:
    raise ValueError(f"JobConfig.micro_batch_size = {cfg.micro_batch_size}: {max_rows} packed rows "
                     f"per consumer ({consumers} consumers) do not split over the mesh's "
                     f"{rows_multiple} batch shards")
  return PackLayout(row_tokens=cfg.seq_len + prefix, max_rows=max_rows, row_unit=unit,
                    prefix_tokens=prefix)


def make_admission(setup: JobSetup):
  """(policy, dispatch): the admission policy (train-batch admission for the
  synchronous schedules) and the seeded order prompt sources start in."""
  cfg = setup.cfg
  policy = make_policy(cfg.policy if cfg.mode == "disaggregated" else "train_batch", cfg.spec)
  # Prompt sources in quota-exact blocks of G, ordered by the dispatch policy.
  dispatch: DispatchStream = make_dispatch(cfg.dispatch, cfg.spec, setup.sources,
                                           np.random.default_rng(cfg.seed))
  return policy, dispatch


def make_evaluator(setup: JobSetup, graphdef) -> Evaluator | None:
  """Held-out evaluation (EvalConfig), or None when it is off."""
  eval_cfg = setup.evaluation
  if not eval_cfg.every_steps:
    return None
  return Evaluator(eval_cfg, graphdef, setup.sampler, setup.suite, setup.trained_sources,
                   setup.cfg.seed)
