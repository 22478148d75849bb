"""The trainer role: one entry point from a step's plan to an optimizer step.

    trainer = Trainer(fns, state, OnDemand(store), layout, mine=range(C))
    trainer.prefetch(work)          # start reading this step's micro-batches (optional)
    result = trainer.step(work)     # read, step; no device-to-host transfer inside
    metrics = result.fetch()        # the step's one host round trip, when it is wanted

`work` (job/work.py) is a mini-batch's plan over every consumer; this trainer reads
and trains the rows of its consumers `mine` only: its local micro-batch k is their
k-th micro-batches side by side. Every caller uses this entry point: the job under
one or many processes (job/local.py, cluster/trainer_actors.py), job/replay.py and both
benchmarks (scripts/bench_transfer.py, scripts/bench_multimodal.py), so the figures
time the code the job runs.

Data flows one way: the reads (dataplane/) return host data; this trainer pads and
processes it and puts it on the devices. `OnDemand`: the trainer's prefetch stream
(job/prefetch.py), one background thread for the whole run, reads this trainer's
micro-batches straight from the storage units and prepares them, fed the stream of
plans, so the next mini-batch is read while the current one trains. `Centralized`:
the baseline, a driver's slice fetched whole before compute.

Exposed wait: before taking a micro-batch that is not ready, the trainer first
waits for the devices to finish the work already dispatched (compute could not
start earlier), so what remains is time the devices sat idle for data: the design
notes' data-ready minus compute-could-start.

Steps: micro-batch by micro-batch (the suite's batch fields beside the common batch:
suites/base.py's BatchFields, e.g. the naive VLM step's images), or a `shared_step`
over the whole mini-batch whose micro-batches share one input read first in the
segment (multimodal/'s encode-once step: each image slot read and encoded once).
Gradient and metric sums stay on the devices; the version is counted on the host.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from knittrans_jax.dataplane import OnDemandReads, describe
from knittrans_jax.dataplane.centralized import CentralizedReads
from knittrans_jax.job.batching import build_batch, build_packed_batch, segment_spans
from knittrans_jax.job.config import PREFETCH_DEPTH
from knittrans_jax.job.prefetch import Inline, Prefetcher
from knittrans_jax.job.work import StepWork
from knittrans_jax.storage import TrajectoryStore
from knittrans_jax.suites.base import BatchFields
from knittrans_jax.train import Checkpointer, StepFunctions, TrainState, check_batch, put_batch
from knittrans_jax.train.batch import batch_shardings
from knittrans_jax.types import Payload


@dataclasses.dataclass(frozen=True)
class OnDemand:
  """Each trainer reads its own micro-batches from the units, `depth` items ahead.
  `read` replaces the store's read (a QuarantiningReader's, in the job); with
  `unit_host` (unit -> host) and this trainer's `host`, the bytes read from units on
  this host are counted (logs/trainer{p}.json)."""
  store: TrajectoryStore
  depth: int = PREFETCH_DEPTH
  read: Callable | None = None
  unit_host: Callable[[str], str] | None = None
  host: str | None = None


@dataclasses.dataclass(frozen=True)
class Centralized:
  """The baseline: `fetch(micro_batches)` returns their payloads (dataplane/centralized.py)."""
  fetch: Callable


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """Static shapes of this trainer's micro-batches: `rows` per micro-batch (its
  consumers' rows), `seq_len` tokens per row."""
  rows: int
  seq_len: int
  vocab_size: int
  rows_multiple: int = 1  # batch shards this trainer's rows split over
  # JobConfig.packing: every row count this trainer's packed micro-batches can have,
  # each compiled at the first step, so no step meets a new shape mid-run.
  packed_rows: tuple[int, ...] = ()


@dataclasses.dataclass
class StepResult:
  """Device values of one step; `fetch` brings them to the host in one transfer."""
  key: tuple[int, int]
  version: int  # policy version after the step
  sums: Any  # metric sums over the mini-batch (loss, tokens, ...)
  grad_norm: Any = None
  grads: Any = None  # with step(apply=False): the mini-batch's gradient

  def fetch(self) -> tuple[dict, float | None]:
    sums, norm = jax.device_get((self.sums, self.grad_norm))
    return {k: float(v) for k, v in sums.items()}, None if norm is None else float(norm)


@dataclasses.dataclass
class _Segment:
  """A fed step's host-side state: each row's slot of the shared input, rows to skip
  for images that could not be read, what the fields' shared read left (`pack`:
  Qwen-VL's, where each image's rows of E are)."""
  work: StepWork
  slot_of: dict = dataclasses.field(default_factory=dict)
  missing: set = dataclasses.field(default_factory=set)
  pack: Any = None


class Trainer:

  def __init__(self, fns: StepFunctions, state: TrainState, data: OnDemand | Centralized,
               layout: BatchLayout, mine: Sequence[int] = (0,), *,
               fields: BatchFields | None = None, shared_step=None,
               version: int | None = None, quarantine=None,
               checkpointer: Checkpointer | None = None, publisher=None,
               process: int = 0, processes: int = 1, log: Callable[[str], None] = print,
               reference=None):
    """fields: the suite's batch fields (suites/base.py; None: the common batch only);
    shared_step: a mini-batch step over a shared input (EncodeOnceStep), with fields
    that read it; reference: the frozen parameters of the KL term's reference policy
    (needed, and only allowed, when the loss has LossConfig.kl_coef > 0)."""
    fields = BatchFields() if fields is None else fields
    if fns.needs_reference and reference is None:
      raise ValueError(f"LossConfig.kl_coef = {fns.loss.kl_coef}: the trainer needs the reference "
                       "policy's parameters (`reference`); the job passes its initial ones")
    if reference is not None and shared_step is not None:
      raise ValueError("LossConfig.kl_coef > 0 with the encode-once VLM step is not built yet; "
                       "set kl_coef = 0 or EncodeOnceConfig off")
    if (shared_step is not None) != fields.shared:
      raise ValueError(f"{type(fields).__name__} with shared_step {shared_step!r}: a mini-batch "
                       "step needs fields that read its shared input, and only it")
    fields.check(processes)
    self.reference = reference
    self.fns, self.state, self.layout, self.mine = fns, state, layout, list(mine)
    self.fields, self.shared_step = fields, shared_step
    self.quarantine, self.checkpointer, self.publisher = quarantine, checkpointer, publisher
    self.process, self.processes, self.log = process, processes, log
    # The one device read of the version; from here it is counted on the host.
    self.version = int(jax.device_get(state.version)) if version is None else version
    self._batch_sh = None
    if isinstance(data, OnDemand):
      self.reads = OnDemandReads(data.store, read=data.read, unit_host=data.unit_host,
                                 host=data.host)
      self.stream = Prefetcher(data.depth)
    else:  # nothing read ahead: the baseline's transfer is all exposed
      self.reads, self.stream = CentralizedReads(data.fetch), Inline()
    self._fed: collections.deque[_Segment] = collections.deque()
    self._last = None  # the newest array the devices are computing
    self.read_ids: list[str] = []  # trajectories this trainer read (logs/trainer{p}.json)
    self._warned: set[str] = set()
    self._warmed = not layout.packed_rows

  # -- the entry point ----------------------------------------------------------------
  def prefetch(self, work: StepWork) -> None:
    """Feeds the step's micro-batches to the stream: reads start now, in order."""
    seg = _Segment(work)
    micros = work.local_micro_batches(self.mine)
    self.read_ids.extend(m.id for micro in micros for m in micro)
    reads = self.reads.segment(micros, read_images=not self.fields.shared)
    jobs = []
    if self.fields.shared:
      if work.images is None:
        raise ValueError(f"step {work.key}: the encode-once trainer needs the work's image plan")
      # Slot numbers are global when the trainer processes hold every consumer (the
      # image array spans them); a lone trainer of some consumers (a benchmark's
      # consumer process) holds only its own slots, numbered from its first.
      everyone = len(self.mine) * self.processes == len(work.consumers)
      if not everyone and self.processes > 1:
        raise ValueError(f"{self.processes} processes x {len(self.mine)} consumers each do not "
                         f"cover the plan's {len(work.consumers)} consumers")
      base = 0 if everyone else self.mine[0] * work.images.slots_per_consumer
      seg.slot_of = {m.id: work.images.index[c][k][i] - base for c in self.mine
                     for k, micro in enumerate(work.consumers[c]) for i, m in enumerate(micro)}
      jobs.append(("the image slots",
                   lambda: self.fields.read_shared(seg, reads.read, self.mine)))
    # Each job runs on the stream's thread: read (host data), prepare, put on the devices.
    jobs += [(describe(k, micro),
              lambda k=k: self._put(self._prepare(seg, reads.micro_batch(k), k)))
             for k, micro in enumerate(micros)]
    self.stream.feed(jobs)
    self._fed.append(seg)

  def pending(self, key: tuple[int, int]) -> StepWork:
    """The prefetched work of step `key` (a follower receives only the key)."""
    if not self._fed or self._fed[0].work.key != key:
      raise RuntimeError(f"step {key} was not prefetched next (pending: "
                         f"{[s.work.key for s in self._fed]})")
    return self._fed[0].work

  def step(self, work: StepWork, apply: bool = True) -> StepResult:
    """One optimizer step on `work` (or, with apply=False, its gradient only)."""
    if not self._fed or self._fed[0].work is not work:
      if self._fed:
        raise RuntimeError(f"step {work.key} while step {self._fed[0].work.key} was prefetched")
      self.prefetch(work)
    self._fed.popleft()
    fns, params = self.fns, self.state.params
    # The loss sum's normaliser (LossConfig.aggregation): by default the mini-batch's
    # loss tokens; its sequences are the trajectories the plan gives advantages.
    total = jnp.float32(fns.loss.normaliser(work.total_tokens, len(work.advantages)))
    sums = None
    if self.shared_step is not None:
      images = self._take()
      micros = (self._take() for _ in range(work.num_micro_batches))  # read as asked for
      grads, sums = self.shared_step.mini_batch_grads(
          params, images, micros, total, on_dispatch=lambda acc_e: setattr(self, "_last", acc_e))
    else:
      grads = fns.zero_grads(params)
      for _ in range(work.num_micro_batches):
        batch = self._take()
        if sums is None:
          sums = fns.zero_sums(self.state, batch, self.reference)
        grads, sums = fns.micro_step(self.state, grads, sums, batch, total, self.reference)
        self._last = sums
        if not self._warmed:
          self._warm_packed_shapes(batch)
    self._report_quarantine()
    if not apply:
      return StepResult(work.key, self.version, sums, grads=grads)
    self.state, metrics = fns.apply_step(self.state, grads)
    self.version += 1
    self._last = metrics["grad_norm"]
    return StepResult(work.key, self.version, sums, grad_norm=metrics["grad_norm"])

  def _warm_packed_shapes(self, batch: dict) -> None:
    """Compiles the micro step for the packed row counts `batch` does not have, on
    all-padding batches (no token counts; the gradients are dropped): a row count met
    first mid-run would cost that step its tracing and compilation (~0.5 s here)."""
    self._warmed = True
    have = batch["tokens"].shape[0]
    for rows in self.layout.packed_rows:
      if rows == have:
        continue
      host = {k: np.zeros((rows,) + v.shape[1:], v.dtype) for k, v in batch.items()}
      zeros = self._put(host)
      fns = self.fns
      fns.micro_step(self.state, fns.zero_grads(self.state.params),
                     fns.zero_sums(self.state, zeros, self.reference), zeros, jnp.float32(1),
                     self.reference)

  # -- reading ------------------------------------------------------------------------
  def _take(self):
    if self._last is not None and not self.stream.ready():
      jax.block_until_ready(self._last)  # waiting on compute is not waiting on data
    return self.stream.take()

  def _put(self, batch: dict) -> dict:
    if self._batch_sh is None or self._batch_sh.keys() != batch.keys():
      self._batch_sh = batch_shardings(self.fns.mesh, self.fns.rules, batch)
    return put_batch(batch, self._batch_sh)

  def _prepare(self, seg: _Segment, payload: Payload, k: int) -> dict:
    """Local micro-batch k's payload -> the step's static-shape host arrays
    (right-padded, or packed as the plan says)."""
    lay = self.layout
    if seg.missing:  # an image that could not be read: its rows do not train
      keep = [i for i, m in enumerate(payload.metas) if m.image_ids[0] not in seg.missing]
      for i in set(range(len(payload.metas))) - set(keep):
        m = payload.metas[i]
        if self.quarantine is not None:
          self.quarantine.bad_rows.setdefault(m.id, f"image {m.image_ids[0]} could not be read")
      payload = Payload([payload.metas[i] for i in keep], [payload.tokens[i] for i in keep],
                        [payload.logprobs[i] for i in keep], [payload.loss_mask[i] for i in keep],
                        payload.images)
    spans = None
    if seg.work.packed:  # the tiny VLM's image before each segment's text (encode-once only)
      rows, row_of = seg.work.local_rows(self.mine, k)
      P = self.fields.prefix_tokens
      row_tokens = lay.seq_len + P
      spans = segment_spans(payload, row_of, row_tokens, rows, P)  # Qwen-VL's M-RoPE too
      batch = build_packed_batch(payload, seg.work.advantages, row_of, row_tokens, rows, P,
                                 seg.slot_of if P else None, spans)
    else:
      batch = build_batch(payload, seg.work.advantages, lay.seq_len, lay.rows)
    for m, mask in zip(payload.metas, payload.loss_mask):  # the normaliser was planned from these
      if int(np.count_nonzero(mask)) != m.trained_tokens:
        raise RuntimeError(
            f"trajectory {m.id}: its loss mask has {int(np.count_nonzero(mask))} tokens of 1 but its "
            f"metadata counts {m.trained_tokens} (loss_tokens={m.loss_tokens}, response_len="
            f"{m.response_len}): the store's row and its payload disagree")
    self.fields.add(batch, payload, seg, spans)
    check_batch(batch, lay.vocab_size, lay.rows_multiple)
    return batch

  def _report_quarantine(self) -> None:
    if self.quarantine is None:
      return
    for unit, why in list(self.quarantine.quarantined.items()):  # the stream's thread adds
      if unit not in self._warned:
        self._warned.add(unit)
        self.log(f"\nprocess {self.process}: storage unit {unit} quarantined ({why}); its "
                 "readable rows are still used")

  # -- weights, checkpoints, the end ----------------------------------------------------
  def write_weights(self) -> None:
    """This process's parameter shards of the current version (every process)."""
    self.publisher.write_part(self.version, self.state.params)

  def commit_weights(self) -> None:
    """(process 0, once every process wrote its part) The version becomes the latest."""
    self.publisher.commit(self.version, parts=self.processes)

  def save_due(self) -> bool:
    return self.checkpointer.should_save(self.version)

  def save(self, progress: dict, force: bool = False) -> bool:
    """Orbax writes from every process; the progress JSON is process 0's."""
    return self.checkpointer.save(self.state, progress, force=force, step=self.version)

  def durable_step(self) -> int | None:
    """The latest version whose checkpoint is wholly written (retention's cue)."""
    return self.checkpointer.durable_step()

  @property
  def exposed_wait_s(self) -> float:
    return self.stream.stats.exposed_wait_s

  @property
  def raw_transfer_s(self) -> float:
    return self.stream.stats.raw_transfer_s

  def close(self) -> None:
    self.stream.close()
    if self.publisher is not None:
      self.publisher.close()  # shared-memory segments do not outlive the trainer

  def finish(self, workdir: str | None = None) -> None:
    self.close()
    if self.checkpointer is not None:
      self.checkpointer.wait()
      self.checkpointer.close()
    if workdir is not None:
      os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
      q = self.quarantine
      with open(os.path.join(workdir, "logs", f"trainer{self.process}.json"), "w") as f:
        json.dump({"process": self.process, "processes": self.processes,
                   "consumers": self.mine, "exposed_data_wait_s": self.exposed_wait_s,
                   "raw_transfer_s": self.raw_transfer_s, "read_ids": self.read_ids,
                   "bytes_read": self.reads.stats.bytes_read,
                   "bytes_local": self.reads.stats.bytes_local,
                   "quarantined_units": q.quarantined if q else {},
                   "skipped_rows": q.bad_rows if q else {}}, f)
