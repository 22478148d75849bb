"""The training job: controller + trainer in this process, rollout workers beside it.

One trajectory's journey: a worker generates it and appends it to its storage unit
(rollout/worker.py), reports metadata; the controller feeds the group to admission
(admission/), plans the admitted mini-batch's micro-batches (dataplane/), reads
them from the store with the next one prefetched (storage/), and the trainer
steps (train/). Weights go back to the workers through the work dir (rollout/weights.py).

Under jax.distributed (job/distributed.py) every process is a trainer: process 0
runs the controller and sends each step's plan to the others, which `follow()`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from knittrans_jax import gin_cli
from knittrans_jax.admission import GroupInfo, make_policy
from knittrans_jax.dataplane import PrefetchingReader, centralized, plan_micro_batches
from knittrans_jax.job.batching import build_batch, group_advantages_by_id
from knittrans_jax.job.config import JobConfig
from knittrans_jax.job.distributed import PlanChannel, barrier
from knittrans_jax.job.metrics import MetricsLog
from knittrans_jax.models import DecoderConfig, ViTConfig
from knittrans_jax.models.vlm import make_model
from knittrans_jax.multimodal import (EncodeOnceConfig, EncodeOnceStep, check_deterministic,
                                      naive_vlm_forward, plan_images, read_slot_images,
                                      slots_from_images)
from knittrans_jax.rl import LossConfig
from knittrans_jax.rollout import tasks
from knittrans_jax.rollout.groups import rollout_groups, suite_prompt_len, suite_sources
from knittrans_jax.rollout.remote import ControlServer
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.rollout.weights import WeightPublisher
from knittrans_jax.rollout.worker import worker_main
from knittrans_jax.sim.workload import PromptStream
from knittrans_jax.storage import StoreSchema, TrajectoryStore
from knittrans_jax.storage.quarantine import QuarantiningReader
from knittrans_jax.train import (CheckpointConfig, Checkpointer, MeshConfig, OptimizerConfig,
                                 StepFunctions, abstract_state, check_batch, init_train_state,
                                 make_mesh, make_optimizer)
from knittrans_jax.train.batch import batch_shardings, put_batch, rows_multiple
from knittrans_jax.train.mesh import logical_sharding, replicated
from knittrans_jax.train.step import text_forward


class Job:

  def __init__(self, workdir: str, resume: bool = False):
    self.workdir = os.path.abspath(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    self.cfg = cfg = JobConfig()
    self.process, self.processes = jax.process_index(), jax.process_count()
    self.controller = self.process == 0
    self.channel = PlanChannel()
    if self.processes > 1 and (cfg.mode != "disaggregated" or cfg.data_path != "ondemand"):
      raise ValueError(f"{self.processes} trainer processes need JobConfig.mode = 'disaggregated' "
                       f"and data_path = 'ondemand' (got {cfg.mode!r}, {cfg.data_path!r}); the "
                       "colocated reference and the centralized baseline run in one process")
    self.consumers = cfg.consumers or self.processes
    if self.consumers % self.processes or cfg.micro_batch_size % self.consumers:
      raise ValueError(f"JobConfig.consumers = {self.consumers} must be a multiple of the "
                       f"{self.processes} trainer processes and divide micro_batch_size = "
                       f"{cfg.micro_batch_size}")
    self.model_cfg = DecoderConfig()
    self.sampler_cfg = SamplerConfig()
    self.loss_cfg = LossConfig()
    spec = cfg.spec
    self.vision = cfg.suite == "vision"
    self.vit_cfg = ViTConfig() if self.vision else None
    self.sources = suite_sources(cfg.suite)
    self.prompt_len = suite_prompt_len(cfg.suite)
    if self.model_cfg.vocab_size < tasks.VOCAB_SIZE:
      raise ValueError(f"DecoderConfig.vocab_size = {self.model_cfg.vocab_size} < the tasks' "
                       f"vocabulary {tasks.VOCAB_SIZE}")
    if cfg.seq_len < self.prompt_len + self.sampler_cfg.max_new_tokens:
      raise ValueError(f"JobConfig.seq_len = {cfg.seq_len} < prompt {self.prompt_len} + "
                       f"max_new_tokens {self.sampler_cfg.max_new_tokens}")
    unknown = set(spec.source_quota or {}) - set(self.sources)
    if unknown:
      raise ValueError(f"TrainBatchSpec.source_quota names unknown sources {sorted(unknown)}; "
                       f"the {cfg.suite} tasks are {self.sources}")
    model_fn = lambda r: make_model(self.model_cfg, self.vit_cfg, r)  # noqa: E731
    if self.vision:
      if cfg.encode_once:  # refuses dropout with the reason (encoding once would change it)
        with nnx.use_eager_sharding(False):
          check_deterministic(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))
      elif self.vit_cfg.dropout:
        raise ValueError(f"ViTConfig.dropout = {self.vit_cfg.dropout}: the trainer keeps no "
                         "dropout rng state; set it to 0")
    mesh_cfg = MeshConfig()
    self.mesh = make_mesh(mesh_cfg)
    self.rules = mesh_cfg.rules
    tx = make_optimizer(OptimizerConfig())
    self.graphdef, self.state, shardings = init_train_state(model_fn, tx, self.mesh, self.rules,
                                                            cfg.seed)
    forward = naive_vlm_forward() if self.vision else text_forward
    self.fns = StepFunctions(self.graphdef, shardings, tx, self.loss_cfg, self.mesh, self.rules,
                             forward=forward)
    self.encode_once = (EncodeOnceStep(self.fns, EncodeOnceConfig())
                        if self.vision and cfg.encode_once else None)
    self.rows_multiple = rows_multiple(self.mesh, self.rules)
    if cfg.micro_batch_size % self.rows_multiple:
      raise ValueError(f"JobConfig.micro_batch_size = {cfg.micro_batch_size} does not split over "
                       f"the mesh's {self.rows_multiple} batch shards")
    if self.processes > 1:
      self._check_rows_per_process()
    self.local_rows = cfg.micro_batch_size // self.processes  # this process's rows per step
    self.ckpt = Checkpointer(os.path.join(self.workdir, "checkpoints"), CheckpointConfig())
    if not resume and (self.ckpt.latest_step() is not None
                       or os.path.exists(os.path.join(self.workdir, "store"))):
      raise ValueError(f"{self.workdir} holds a previous run: pass --resume to continue it, "
                       "--overwrite to start over, or another --workdir")
    self.progress = {"consumed": [], "next_group": 0, "steps": 0, "position": None}
    if resume:
      restored = self.ckpt.restore(abstract_state(self.state, shardings))
      if restored is None:
        print(f"--resume: no checkpoint in {self.ckpt.directory}; starting fresh")
      else:
        self.state, self.progress = restored
    self.store_url = cfg.store_url or "file://" + os.path.join(self.workdir, "store")
    barrier("knittrans_checked")  # every process looked before process 0 creates the store
    if self.controller:
      self.store = TrajectoryStore.create(self.store_url, StoreSchema(
          sources=self.sources, max_prompt_len=self.prompt_len,
          max_response_len=self.sampler_cfg.max_new_tokens))
    barrier("knittrans_store_created")
    if not self.controller:
      self.store = TrajectoryStore.open(self.store_url)
    # A damaged unit is quarantined, not fatal: its readable rows and every other
    # unit still train; skipped rows show as tokens_skipped in metrics.jsonl.
    self.quarantine = QuarantiningReader(self.store)
    policy = cfg.policy if cfg.mode == "disaggregated" else "train_batch"
    self.policy = make_policy(policy, spec)
    # Prompt sources in quota-exact blocks of G, shuffled (the data loader).
    self.quotas = PromptStream(spec, self.sources,
                               np.random.default_rng([cfg.seed, self.progress["next_group"]]))
    self.log = (MetricsLog(self.workdir, spec, resume=resume, upto_step=self.version)
                if self.controller else None)
    self.consumed = set(self.progress["consumed"])
    self.seen_groups = {int(g) for g in self.progress.get("consumed_groups", [])}
    self.next_group = self.progress["next_group"]
    self.consumed_groups = set(self.seen_groups)
    if self.progress.get("position"):
      self.policy.restore_position(self.progress["position"])
    self.publisher = WeightPublisher(self.workdir) if self.controller else None
    self._gather = None  # params -> replicated, when they are split across processes
    self.read_ids: list[str] = []  # trajectories this process read (logs/trainer{p}.json)
    self._warned: set[str] = set()  # quarantined units already reported
    self.image_shape = ((self.vit_cfg.image_size, self.vit_cfg.image_size, self.vit_cfg.channels)
                        if self.vision else None)
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slot-images")
    self.exposed_wait_s = 0.0
    self.raw_transfer_s = 0.0
    self._batch_sh = None

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

  @property
  def version(self) -> int:
    return int(jax.device_get(self.state.version))

  # -- training one admitted mini-batch ---------------------------------------
  def train(self, mb) -> None:
    """(controller) Plans the mini-batch over the consumers, has every trainer
    process step on its share, and records the step."""
    cfg = self.cfg
    metas = [m for grp in mb.groups for m in grp.metas]
    if any(m.id in self.consumed for m in metas):
      raise RuntimeError(f"mini-batch {mb.train_batch}.{mb.index} would train a trajectory twice")
    plan = plan_micro_batches(mb, self.consumers, cfg.micro_batch_size // self.consumers)
    adv = group_advantages_by_id(mb.groups, self.loss_cfg.normalize_adv_std)
    total = sum(m.response_len for m in metas)  # every response token trains (tasks' mask)
    v_consume = self.version
    iplan = None
    if self.encode_once is not None:
      # Every process's slots must split over its batch shards (fixed shapes).
      C = self.consumers
      iplan = plan_images(plan.consumers, slot_multiple=self.rows_multiple // math.gcd(
          self.rows_multiple, C), min_slots=-(-cfg.spec.mini_batch_groups // C))
    sums, grad_norm = self._all("train", consumers=plan.consumers, adv=adv, total=total,
                                iplan=iplan)
    self.consumed.update(m_.id for m_ in metas)
    self.consumed_groups.update(grp.group_id for grp in mb.groups)
    self.log.step(mb, metas, v_consume, sums, grad_norm, admitted_tokens=total)

  def _all(self, command: str, **kwargs):
    """(controller) Runs `command` here and in every other trainer process."""
    self.channel.send((command, kwargs))
    return getattr(self, "_do_" + command)(**kwargs)

  def follow(self) -> None:
    """(processes > 0) Carries out the controller's commands until it finishes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # process 0 decides when the run stops
    while True:
      command, kwargs = self.channel.receive()
      if command == "abort":
        raise RuntimeError(f"process 0 failed ({kwargs['reason']}); process {self.process} "
                           "stops too")
      getattr(self, "_do_" + command)(**kwargs)
      if command == "finish":
        return

  def _do_train(self, consumers, adv, total, iplan):
    """One optimizer step; this process reads and trains only its consumers' rows:
    its local micro-batch k is their k-th micro-batches side by side."""
    cfg = self.cfg
    per_process = self.consumers // self.processes
    mine = range(self.process * per_process, (self.process + 1) * per_process)
    micros = [tuple(m for c in mine for m in consumers[c][k])
              for k in range(len(consumers[0]))]
    self.read_ids.extend(m.id for micro in micros for m in micro)
    dedup = iplan is not None
    slot_of = {m.id: iplan.index[c][k][i] for c in mine for k, micro in enumerate(consumers[c])
               for i, m in enumerate(micro)} if dedup else {}
    received_images = {}  # centralized path: the images that came with the slices

    def prepare(payload):
      batch = build_batch(payload, adv, cfg.seq_len, self.local_rows)
      if int(batch["loss_mask"].sum()) != sum(m.response_len for m in payload.metas):
        raise RuntimeError("loss mask disagrees with the response lengths")
      if dedup:
        index = np.zeros(self.local_rows, np.int32)  # padding rows: any slot, no loss
        index[:len(payload.metas)] = [slot_of[m.id] for m in payload.metas]
        batch["image_index"] = index
        received_images.update(payload.images)
      elif self.vision:  # the naive step: the image copied into every row
        images = np.zeros((self.local_rows, *self.image_shape), np.float32)
        for i, m in enumerate(payload.metas):
          images[i] = payload.images[m.image_ids[0]]
        batch["images"] = images
      check_batch(batch, self.model_cfg.vocab_size, self.rows_multiple // self.processes)
      return batch

    def put(batch):  # onto the devices with the step's sharding, ahead of use
      if self._batch_sh is None:
        self._batch_sh = batch_shardings(self.mesh, self.rules, batch)
      return put_batch(batch, self._batch_sh)

    def my_slots(read):
      return np.concatenate([read(c) for c in mine])

    slots = None
    if cfg.data_path == "centralized":
      batches, waited = self._centralized(micros, prepare, put)
      if dedup:
        slots = my_slots(lambda c: slots_from_images(iplan, c, received_images,
                                                     self.image_shape))
      self.exposed_wait_s += waited
      self.raw_transfer_s += waited  # nothing overlaps compute
    else:
      # On-demand: this process reads only its micro-batches, prefetching ahead; the
      # encode-once path reads each image once, into its slot, alongside.
      if dedup:
        pending = self._pool.submit(my_slots, lambda c: read_slot_images(
            self.store, iplan, c, self.image_shape))
      batches = PrefetchingReader(self.store, micros, prepare, cfg.prefetch_depth, put,
                                  read_images=not dedup, read=self.quarantine.read)
      if dedup:
        t0 = time.perf_counter()
        slots = pending.result()
        waited = time.perf_counter() - t0
        self.exposed_wait_s += waited
        self.raw_transfer_s += waited
    try:
      if dedup:
        grads, sums = self._encode_once_grads(slots, batches, total)
      else:
        grads = self.fns.zero_grads(self.state.params)
        sums = collections.Counter()
        for batch in batches:
          g, s = self.fns.grad_step(self.state, batch, total)
          grads = self.fns.accumulate(grads, g)
          sums.update({key: float(v) for key, v in jax.device_get(s).items()})
    finally:
      if isinstance(batches, PrefetchingReader):
        batches.close()
        self.exposed_wait_s += batches.stats.exposed_wait_s
        self.raw_transfer_s += batches.stats.raw_transfer_s
    self.state, m = self.fns.apply_step(self.state, grads)
    for unit, why in self.quarantine.quarantined.items():
      if unit not in self._warned:
        self._warned.add(unit)
        print(f"\nprocess {self.process}: storage unit {unit} quarantined ({why}); its "
              "readable rows are still used")
    return sums, float(jax.device_get(m["grad_norm"]))

  def _do_publish(self):
    """New weights for the rollout workers; gathered first when split across processes."""
    params = self.state.params
    if not all(x.is_fully_replicated for x in jax.tree.leaves(params)):
      if self._gather is None:
        self._gather = jax.jit(lambda p: p, out_shardings=replicated(self.mesh))
      params = self._gather(params)
    if self.controller:
      self.publisher.publish(self.version, params)

  def _do_save(self, force=False):
    # Orbax writes a checkpoint from every process; the progress JSON from process 0.
    if self.controller:
      self.progress = {"consumed": sorted(self.consumed), "consumed_groups": sorted(
                           str(g) for g in self.consumed_groups), "next_group": self.next_group,
                       "steps": self.version, "position": self.policy.position()}
    self.ckpt.save(self.state, self.progress if self.controller else {}, force=force)

  def _do_finish(self):
    self.ckpt.wait()
    self.ckpt.close()
    self._pool.shutdown(wait=False)
    os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
    with open(os.path.join(self.workdir, "logs", f"trainer{self.process}.json"), "w") as f:
      json.dump({"process": self.process, "processes": self.processes,
                 "consumers": self.consumers, "exposed_data_wait_s": self.exposed_wait_s,
                 "raw_transfer_s": self.raw_transfer_s, "read_ids": self.read_ids,
                 "quarantined_units": self.quarantine.quarantined,
                 "skipped_rows": self.quarantine.bad_rows}, f)

  def _encode_once_grads(self, slots, batches, total):
    """Encode the mini-batch's images once, run the backbone micro-batches as they
    arrive, then the one encoder VJP (multimodal/encode_once.py)."""
    step, params = self.encode_once, self.state.params
    images = jax.make_array_from_process_local_data(step.images_sharding, slots)
    encoded = step.encode(params, images)
    acc, acc_e = self.fns.zero_grads(params), step.zero_embed_grads(encoded)
    sums = collections.Counter()
    for batch in batches:
      acc, acc_e, s = step.backbone(params, encoded, acc, acc_e, batch, total)
      sums.update({key: float(v) for key, v in jax.device_get(s).items()})
    return step.encoder_grads(params, images, encoded, acc, acc_e), sums

  def _centralized(self, micros, prepare, put):
    """The baseline data path: gather the mini-batch, pickle this consumer's slice
    (images copied per trajectory) and pass it through an OS pipe from a driver
    thread; all of it before compute starts. (The benchmark runs the full
    multi-process version: scripts/bench_transfer.py.)"""
    t0 = time.perf_counter()
    recv_end, send_end = mp.Pipe(duplex=False)
    payload = centralized.gather(self.store, [m for mb in micros for m in mb])
    data = centralized.serialize(centralized.consumer_slice(payload, micros))
    sender = threading.Thread(target=send_end.send_bytes, args=(data,))
    sender.start()
    received = centralized.deserialize(recv_end.recv_bytes())
    sender.join()
    batches = [put(prepare(centralized.to_payload(s))) for s in received]
    return batches, time.perf_counter() - t0

  def save(self, force=False):
    self._all("save", force=force)

  # -- the two modes ------------------------------------------------------------
  def run(self) -> dict:
    t0 = time.perf_counter()
    target = self.cfg.train_batches * self.cfg.spec.num_mini_batches
    self.bar = tqdm(total=target, initial=min(self.version, target), desc=self.cfg.mode,
                    unit="step", dynamic_ncols=True, mininterval=0.5)
    # Ctrl-C only sets a flag: the loops stop at the next step boundary, so a step is
    # never half recorded (state advanced but its trajectories not marked consumed).
    self.stop_requested = False

    def on_sigint(signum, frame):
      self.stop_requested = True
    previous = signal.signal(signal.SIGINT, on_sigint)
    completed = False
    try:
      self._feed_unconsumed()
      if self.cfg.mode == "colocated":
        self._colocated(target)
      else:
        self._disaggregated(target)
      if self.stop_requested:
        print("\ninterrupted: saving a checkpoint; resume with --resume")
      completed = True
    finally:
      signal.signal(signal.SIGINT, previous)
      self.bar.close()
      if completed or self.processes == 1:
        try:
          self.save(force=True)
        finally:
          self._all("finish")
      else:
        # A failure may have come mid-step, with the others inside a collective: no
        # collective checkpoint now (the last periodic one stands); tell them to stop.
        self.channel.send(("abort", {"reason": repr(sys.exc_info()[1])}))
    self.log.close()
    summary = self.log.summary(wall_s=time.perf_counter() - t0,
                               exposed_data_wait_s=self.exposed_wait_s,
                               raw_transfer_s=self.raw_transfer_s, mode=self.cfg.mode,
                               policy=self.policy.name)
    with open(os.path.join(self.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    gin_cli.save_operative_config(self.workdir)
    return summary

  def _feed_unconsumed(self):
    """On resume: committed groups that were not trained go back to admission, so
    nothing committed is skipped (and consumed ones are never fed again)."""
    groups = collections.defaultdict(list)
    for unit in self.store.units():
      for m in self.store.list_committed(unit):
        # Group ids committed after the checkpoint must never be dispatched again
        # (a second copy would finish the same group twice).
        self.next_group = max(self.next_group, m.group_id + 1)
        if m.id not in self.consumed:
          groups[m.group_id].append(m)
    complete = [sorted(ms, key=lambda m: m.index_in_group) for ms in groups.values()
                if len(ms) == self.cfg.spec.group_size]
    for metas in sorted(complete, key=lambda ms: ms[0].group_id):
      self.policy.dispatched(metas[0].source)
      self._finished(metas)
    self.resumed_groups = len(complete)

  def _after_step(self):
    self.bar.update(1)
    self.bar.set_postfix(self.log.postfix(), refresh=False)

  def _colocated(self, target):
    spec, n = self.cfg.spec, self.cfg.spec.group_size
    writer = self.store.writer("colocated")
    while self.version < target and not self.stop_requested:
      # Train batch k is groups k*G .. k*G + G-1 with fixed sources, so a resumed run
      # regenerates exactly the groups an uninterrupted run would have had.
      k, G = self.policy.train_batch, spec.groups_per_batch
      sources = ([s for s, q in sorted(spec.source_quota.items()) for _ in range(q)]
                 if spec.source_quota else [self.sources[p % len(self.sources)] for p in range(G)])
      requests = [(k * G + p, s) for p, s in enumerate(sources) if k * G + p not in self.seen_groups]
      self.next_group = max(self.next_group, (k + 1) * G)
      for s in {s for _, s in requests}:
        self.policy.dispatched(s, sum(src == s for _, src in requests))
      for lo in range(0, len(requests), 16):
        chunk = requests[lo:lo + 16]
        for group in rollout_groups(self.graphdef, self.state.params, self.version,
                                    self.cfg.seed, chunk, n, self.sampler_cfg, self.cfg.suite,
                                    self.image_shape[0] if self.vision else 0):
          self._finished(writer.append(group.trajectories, images=group.images))
      while not self.stop_requested and (mb := self.policy.admit(self.version)) is not None:
        self.train(mb)
        self._after_step()
        self.save()

  def _finished(self, metas):
    self.seen_groups.add(metas[0].group_id)
    self.policy.finished(GroupInfo.from_metas(metas))

  def _disaggregated(self, target):
    cfg, spec = self.cfg, self.cfg.spec
    self._all("publish")
    ctx = mp.get_context("spawn")
    reports, stop = ctx.Queue(), ctx.Event()
    workers, requests = {}, {}
    assigned: dict[int, tuple[int, str]] = {}  # group id -> (worker, source)

    def start(w):
      requests[w] = ctx.Queue()
      p = ctx.Process(target=worker_main, daemon=True, args=(
          w, self.workdir, self.store_url, cfg.seed, spec.group_size, self.model_cfg,
          self.sampler_cfg, requests[w], reports, stop),
          kwargs=dict(suite=cfg.suite, vit_config=self.vit_cfg))
      p.start()
      workers[w] = p

    for w in range(cfg.workers):
      start(w)
    control = None
    if cfg.control_address:  # rollout workers on other hosts may join (rollout/remote.py)
      used = [int(u[6:]) for u in self.store.units() if u.startswith("worker") and u[6:].isdigit()]
      control = ControlServer(self.workdir, cfg.control_address, max([cfg.workers - 1, *used]) + 1,
                              dict(store_url=self.store_url, seed=cfg.seed, n=spec.group_size,
                                   store_in_workdir=cfg.store_url is None,
                                   model_config=self.model_cfg, sampler_config=self.sampler_cfg,
                                   suite=cfg.suite, vit_config=self.vit_cfg))
      print(f"serving remote rollout workers at {control.address} "
            f"(scripts/rollout_worker.py --workdir {self.workdir})")

    def send(w, request):
      (requests[w] if w in workers else control.requests[w]).put(request)

    def handle(msg):
      if msg[0] == "done":
        _, w, gid, metas = msg
        if assigned.pop(gid, None) is not None:
          self._finished(metas)
      elif msg[0] in ("alive", "hello"):
        if msg[0] == "hello":
          print(f"\nremote rollout worker {msg[1]} joined from {msg[2]}")
        control.seen(msg[1])
      else:
        print(f"\nrollout worker {msg[1]} failed:\n{msg[2]}")

    replace = collections.deque()
    in_window, dropped_seen = self.resumed_groups, len(self.policy.dropped)
    self.restarts = 0
    try:
      while self.version < target and not self.stop_requested:
        # Dispatch up to the window; dropped or failed groups are replaced first.
        ready = [*workers, *(control.alive() if control else ())]
        while ready and in_window < cfg.groups_in_flight:
          gid = self.next_group
          self.next_group += 1
          source = replace.popleft() if replace else self.quotas.next()
          w = min(ready, key=lambda w: sum(a == w for a, _ in assigned.values()))
          send(w, (gid, source))
          assigned[gid] = (w, source)
          self.policy.dispatched(source)
          in_window += 1
        # Reports: block briefly only when there is nothing to train.
        queues = [reports, control.reports] if control else [reports]
        for k, q in enumerate(queues):
          try:
            msg = q.get(timeout=0.05 if k == 0 else 0)
          except queue.Empty:
            continue
          while msg is not None:
            handle(msg)
            try:
              msg = q.get_nowait()
            except queue.Empty:
              msg = None
        in_window -= self._recover_dead_workers(workers, assigned, replace, start)
        if control:
          for w in control.silent():
            print(f"\nremote rollout worker {w} silent for {control.timeout_s:.0f} s; "
                  "re-dispatching what it held")
            control.forget(w)
            in_window -= self._release(w, assigned, replace)
        while (mb := self.policy.admit(self.version)) is not None:
          self.train(mb)
          in_window -= len(mb.groups)
          self._all("publish")
          self._after_step()
          self.save()
          if self.version >= target or self.stop_requested:
            break
        for grp, why in self.policy.dropped[dropped_seen:]:
          replace.append(grp.source)
          in_window -= 1
        dropped_seen = len(self.policy.dropped)
    finally:
      stop.set()
      if control:
        control.close()
      for w in workers:
        requests[w].put(None)
      for p in workers.values():
        p.join(timeout=10)
        if p.is_alive():
          p.terminate()

  def _recover_dead_workers(self, workers, assigned, replace, start) -> int:
    """Restarts dead local workers after releasing what they held. Returns groups failed."""
    failed = 0
    for w, p in list(workers.items()):
      if p.is_alive():
        continue
      print(f"\nrollout worker {w} died (exit code {p.exitcode}); restarting it")
      self.restarts += 1
      failed += self._release(w, assigned, replace)
      start(w)
    return failed

  def _release(self, w, assigned, replace) -> int:
    """A lost worker's groups: those fully committed in its unit count as finished;
    the rest are reported failed and re-dispatched. Returns groups failed."""
    held = {gid: s for gid, (ww, s) in assigned.items() if ww == w}
    unit = f"worker{w}"
    committed = collections.defaultdict(list)
    if held and unit in self.store.units():
      for m in self.store.list_committed(unit):
        if m.group_id in held:
          committed[m.group_id].append(m)
    failed = 0
    for gid, source in held.items():
      del assigned[gid]
      if len(committed[gid]) == self.cfg.spec.group_size:
        self._finished(sorted(committed[gid], key=lambda m: m.index_in_group))
      else:
        self.policy.failed(source)
        replace.append(source)
        failed += 1
    return failed


def run(workdir: str, resume: bool = False) -> dict | None:
  """Runs the job; in a process other than 0 of a distributed trainer, follows the
  controller and returns None."""
  job = Job(workdir, resume)
  if not job.controller:
    job.follow()
    return None
  return job.run()
