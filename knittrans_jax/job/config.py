"""The training job's knobs (gin: configs/text_grpo_tiny.gin)."""
from __future__ import annotations

import dataclasses
import os

import gin

from knittrans_jax.admission import POLICIES, TrainBatchSpec
from knittrans_jax.admission.dispatch import DISPATCH_POLICIES
from knittrans_jax.rollout.engine import ENGINES

# Defaults that the classes below the config share, written once here.
PREFETCH_DEPTH = 2  # micro-batches read ahead of the step (job/prefetch.py, OnDemand)
STALL_TIMEOUT_S = 600.0  # no progress this long stops a run (job/controller.py)

MODES = ("disaggregated", "colocated", "synchronous")
CLUSTERS = ("local", "ray")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class JobConfig:
  """mode: 'disaggregated' (R worker processes, admission by `policy`),
  'colocated' (generate a train batch in the trainer process with the current
  weights, then train on it) or 'synchronous' (the colocated schedule run by the
  disaggregated code path: the same worker processes, sampler and data path, each
  train batch dispatched only once the previous one is trained and its weights
  published; the reference that differs from 'disaggregated' in staleness alone).
  window: groups dispatched but not yet trained (default 2G, one-step-off).
  micro_batch_size: rows per micro-batch (a mini-batch is g * n rows); with `packing`,
    the most packed rows a micro-batch has.
  seq_len: static sequence length of a train batch (prompt + response); with
    `packing`, the tokens of a packed row (a trajectory must fit one).
  packing: micro-batches by token budget (dataplane/packing.py): each consumer's
    trajectories packed back to back into rows of seq_len tokens, attention and
    positions per trajectory, so no compute goes to padding; a mini-batch takes as
    many micro-batches as its tokens need, each of up to micro_batch_size rows (a
    few row counts, each compiled once). False: a row per trajectory, right-padded.
  suite: 'text' (a decoder on text tasks), 'vision' (a VLM on generated images),
    'math' (a prompt data set through the checkpoint's tokenizer and chat template,
    scored by the verifiable math reward; rollout/math_tasks.py, MathTaskConfig) or
    'agentic' (multi-turn tool episodes run by the agent loop; rollout/agentic_tasks.py,
    AgenticTaskConfig, AgentConfig; seq_len must hold AgentConfig.max_tokens).
  policy: the admission policy (admission/registry.py): ours ('constraint_preserving',
    'train_batch', 'fifo') or a peer's rule ('areal', 'verl', 'nemo_weight_fifo',
    'nemo_windowed', 'prime_rl', 'tinker_discard'; admission/peers.py), whose knobs are
    gin bindings of its class (e.g. ArealPolicy.max_head_offpolicyness); a rule that
    gates starts does so inside `window`.
  dispatch: the order groups start in (admission/dispatch.py): 'shuffled' (the data
    loader's quota-exact blocks in random order), 'quota_aware' (within each
    block, the source whose groups take longest to complete first) or 'ratio' (each
    source drawn by its quota share: prime-rl's sampler, quotas in expectation).
  groups_per_call: the most queued groups a rollout worker generates in one sampler
    call (each call decodes until its longest response stops). 1: each group
    finishes on its own longest response, as in a continuous-batching engine,
    so the sources' length differences show in completion times.
  checkpoint: a Hugging Face decoder directory (models/hf.py) the policy starts
    from; its config.json sets the architecture, DecoderConfig's dtype, param_dtype,
    remat and attention still apply. None: DecoderConfig, randomly initialised. With
    suite 'vision', a Qwen2-VL / Qwen2.5-VL directory (models/qwen_vl.py): the vision
    tasks as its token sequences (rollout/qwen_vision_tasks.py, QwenVisionTaskConfig).
  encode_once: (vision) the deduplicated step, each image encoded once per
    mini-batch (multimodal/); False runs the naive step, the encoder per trajectory.
  consumers: data-parallel consumers a mini-batch is planned over (dataplane/);
    default one per trainer process. Each process trains its consumers' rows; one
    process given C > 1 trains all C's rows (the single-process reference of a
    C-process run).
  engine: the rollout engine of the workers (rollout/engine.py): 'jax' (the project's
    sampler, a static batch of up to `groups_per_call` groups per call; every suite) or
    'vllm' (an in-process vLLM engine per worker, continuous batching, each group
    reported the step it finishes; text, math and agentic suites, head dim >= 32 on
    CPU; VllmOptions) or 'vllm_server' (a vLLM server per worker that the user runs on
    the worker's host, VllmServerOptions.urls; docs/rollout.md). Held-out evaluation
    runs the JAX sampler; the colocated mode (the JAX sampler in the trainer process)
    refuses both vLLM engines.
  cluster: where the roles run: 'local' (this process trains; rollout workers are its
    child processes; no Ray) or 'ray' (this process is the controller; trainers and
    rollout workers are Ray actors, RayConfig; cluster/, docs/distributed.md).
  compilation_cache: the persistent compilation cache directory every process of the
    job shares (compile_cache.py): a rollout worker loads a sampler shape another
    compiled, and a second run starts without compiling. None: JAX's own setting.
    JAX_COMPILATION_CACHE_DIR in the environment wins.
  stall_timeout_s: a run in which no mini-batch is admitted and no usable group
    finishes for this long stops with an error naming the short sources and what is
    in flight (a hung worker, a source whose groups are all dropped, ...).
  """
  spec: TrainBatchSpec = None
  mode: str = "disaggregated"
  policy: str = "constraint_preserving"
  workers: int = 2
  window: int | None = None
  train_batches: int = 8
  micro_batch_size: int = 32
  seq_len: int = 24
  seed: int = 0
  store_url: str | None = None
  prefetch_depth: int = PREFETCH_DEPTH  # micro-batches read ahead of the step
  data_path: str = "ondemand"  # or 'centralized' (the baseline)
  # A row may go to a consumer on its unit's host if that keeps every consumer's
  # tokens within this fraction of the mean (dataplane/assignment.py); 0: never.
  locality_tolerance: float = 0.05
  suite: str = "text"  # or 'vision', 'math', 'agentic'
  encode_once: bool = True
  consumers: int | None = None
  stall_timeout_s: float = STALL_TIMEOUT_S
  checkpoint: str | None = None
  dispatch: str = "shuffled"
  groups_per_call: int = 4
  engine: str = "jax"
  cluster: str = "local"
  compilation_cache: str | None = "~/.cache/knittrans_jax/jax"
  packing: bool = False

  def __post_init__(self):
    spec = self.spec if self.spec is not None else TrainBatchSpec()
    object.__setattr__(self, "spec", spec)
    if self.mode not in MODES:
      raise ValueError(f"JobConfig.mode = {self.mode!r}: use one of {MODES}")
    rows = spec.mini_batch_groups * spec.group_size
    if self.micro_batch_size <= 0:
      raise ValueError(f"JobConfig.micro_batch_size = {self.micro_batch_size} must be positive")
    if self.packing and self.suite == "vision" and not self.encode_once:
      raise ValueError("JobConfig.packing with suite 'vision' and encode_once = False: the "
                       "naive VLM step (an image copy per row) is not packed; pack the "
                       "encode-once step or set packing = False")
    if not self.packing and rows % self.micro_batch_size:
      raise ValueError(f"JobConfig.micro_batch_size = {self.micro_batch_size} does not divide "
                       f"the mini-batch's {rows} trajectories (g = {spec.mini_batch_groups} x "
                       f"n = {spec.group_size})")
    if not 0 <= self.locality_tolerance < 1:
      raise ValueError(f"JobConfig.locality_tolerance = {self.locality_tolerance}: use a "
                       "fraction in [0, 1)")
    if self.data_path not in ("ondemand", "centralized"):
      raise ValueError(f"JobConfig.data_path = {self.data_path!r}: use 'ondemand' or 'centralized'")
    if self.policy not in POLICIES:
      raise ValueError(f"JobConfig.policy = {self.policy!r}: use one of {sorted(POLICIES)}")
    if self.dispatch not in DISPATCH_POLICIES:
      raise ValueError(f"JobConfig.dispatch = {self.dispatch!r}: use one of {DISPATCH_POLICIES}")
    if self.checkpoint is not None and not os.path.isfile(
        os.path.join(self.checkpoint, "config.json")):
      raise ValueError(f"JobConfig.checkpoint = {self.checkpoint!r} is not a Hugging Face "
                       "checkpoint directory (no config.json)")
    if self.checkpoint is not None and self.suite == "vision":
      self._check_vision_checkpoint()
    if self.consumers is not None:
      self.consumers_for(1)  # its rules, checked early
    if self.engine not in ENGINES:
      raise ValueError(f"JobConfig.engine = {self.engine!r}: use one of {ENGINES}")
    if self.engine != "jax" and self.mode == "colocated":
      raise ValueError(f"JobConfig.engine = {self.engine!r} with mode 'colocated': the colocated "
                       "reference generates in the trainer process with the JAX sampler; mode "
                       "'synchronous' runs the colocated schedule on the vLLM workers")
    if self.engine != "jax" and self.suite == "vision":
      raise ValueError(f"JobConfig.engine = {self.engine!r} with suite 'vision': the VLMs roll "
                       "out on the 'jax' engine (docs/rollout.md says why)")
    if self.cluster not in CLUSTERS:
      raise ValueError(f"JobConfig.cluster = {self.cluster!r}: use one of {CLUSTERS}")
    if self.groups_per_call < 1:
      raise ValueError(f"JobConfig.groups_per_call = {self.groups_per_call} must be >= 1")
    if self.stall_timeout_s <= 0:
      raise ValueError(f"JobConfig.stall_timeout_s = {self.stall_timeout_s} must be > 0")
    if self.mode == "disaggregated":
      need, why = spec.mini_batch_groups, "one mini-batch's g"
      if self.policy == "train_batch":
        need, why = spec.groups_per_batch, "train-batch admission's G"
      if self.groups_in_flight < need:
        raise ValueError(f"JobConfig.window = {self.groups_in_flight} groups in flight cannot "
                         f"hold {why} = {need} groups: nothing could ever be admitted")
    if self.mode != "colocated" and self.workers < 1:
      raise ValueError(f"JobConfig.workers = {self.workers}: at least one rollout worker")

  def _check_vision_checkpoint(self) -> None:
    # Imported here: the config module stays free of the model code (a JobConfig is
    # built in processes that never load a model).
    from knittrans_jax.models.checkpoint_io import read_config
    from knittrans_jax.models.qwen_vl import MODEL_TYPES
    model_type = read_config(self.checkpoint).get("model_type")
    if model_type not in MODEL_TYPES:
      raise ValueError(f"JobConfig.checkpoint = {self.checkpoint!r} has model_type "
                       f"{model_type!r}: the 'vision' suite takes a Qwen-VL checkpoint "
                       f"{MODEL_TYPES} (or none: the tiny VLM); decoders run 'text' and 'math'")

  def consumers_for(self, processes: int) -> int:
    """The data-parallel consumers a mini-batch is planned over when `processes`
    trainer processes train it (default one each). The one place their rules live."""
    C = self.consumers or processes
    if processes > 1 and (self.mode != "disaggregated" or self.data_path != "ondemand"):
      raise ValueError(f"{processes} trainer processes need JobConfig.mode = 'disaggregated' "
                       f"and data_path = 'ondemand' (got {self.mode!r}, {self.data_path!r}); "
                       "the colocated reference and the centralized baseline run in one process")
    if C <= 0 or C % processes or self.micro_batch_size % C:
      raise ValueError(f"JobConfig.consumers = {C} must be a positive multiple of the "
                       f"{processes} trainer process(es) and divide micro_batch_size = "
                       f"{self.micro_batch_size}")
    return C

  @property
  def groups_in_flight(self) -> int:
    return self.window if self.window is not None else 2 * self.spec.groups_per_batch
