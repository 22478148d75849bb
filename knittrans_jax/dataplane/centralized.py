"""The centralized baseline: how single-controller RL stacks move a train batch.

A driver gathers the whole train batch's payload from the producers' storage
units, builds each consumer's slice as per-trajectory samples (every trajectory
carries its own copy of its image, as a batch repeated n times per prompt does),
serialises the slice with pickle and sends it over a real process boundary (a
pipe). The consumer deserialises it, and only then can compute start.
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import pickle
import queue
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from knittrans_jax.dataplane.reader import ReadStats
from knittrans_jax.storage import TrajectoryStore
from knittrans_jax.types import Payload, TrajMeta


def gather(store: TrajectoryStore, metas: Sequence[TrajMeta]) -> Payload:
  """The driver reads every trajectory of the train batch (one batched read)."""
  return store.read(list(metas)).result()


def consumer_slice(payload: Payload, plan: Sequence[Sequence[TrajMeta]]) -> list[list[dict]]:
  """One consumer's micro-batches as lists of per-trajectory samples, images repeated."""
  index = {m.id: i for i, m in enumerate(payload.metas)}
  out = []
  for micro in plan:
    samples = []
    for m in micro:
      i = index[m.id]
      samples.append({
          "meta": m, "tokens": payload.tokens[i], "logprobs": payload.logprobs[i],
          "loss_mask": payload.loss_mask[i],
          # A copy per trajectory: pickle would otherwise send a shared array once.
          "images": [np.array(payload.images[iid], copy=True) for iid in m.image_ids],
      })
    out.append(samples)
  return out


def serialize(slice_: list[list[dict]]) -> bytes:
  return pickle.dumps(slice_, protocol=pickle.HIGHEST_PROTOCOL)


def deserialize(data: bytes) -> list[list[dict]]:
  return pickle.loads(data)


def to_payload(samples: list[dict]) -> Payload:
  """A received micro-batch as the same Payload the on-demand reader yields."""
  images = {}
  for s in samples:
    for iid, img in zip(s["meta"].image_ids, s["images"]):
      images.setdefault(iid, img)
  return Payload(metas=[s["meta"] for s in samples], tokens=[s["tokens"] for s in samples],
                 logprobs=[s["logprobs"] for s in samples],
                 loss_mask=[s["loss_mask"] for s in samples], images=images)


def local_driver(store: TrajectoryStore) -> Callable[[Sequence[Sequence[TrajMeta]]], list[Payload]]:
  """The baseline in one process: a driver gathers this consumer's micro-batches,
  pickles its slice (images copied per trajectory) and passes it through an OS pipe
  from a driver thread; the consumer unpickles. (scripts/bench_transfer.py runs the
  driver in its own process and serves every consumer.)"""
  def fetch(plan):
    recv_end, send_end = mp.Pipe(duplex=False)
    data = serialize(consumer_slice(gather(store, [m for mb in plan for m in mb]), plan))
    sender = threading.Thread(target=send_end.send_bytes, args=(data,))
    sender.start()
    received = deserialize(recv_end.recv_bytes())
    sender.join()
    return [to_payload(s) for s in received]
  return fetch


def payload_read(payloads: Sequence[Payload]) -> Callable[[Sequence[TrajMeta], Any], Payload]:
  """A read function (like a store's) over payloads already received."""
  rows = {m.id: (p, i) for p in payloads for i, m in enumerate(p.metas)}
  images = {iid: img for p in payloads for iid, img in p.images.items()}

  def read(metas, skip_images=()):
    got = [rows[m.id] for m in metas]
    return Payload(metas=list(metas), tokens=[p.tokens[i] for p, i in got],
                   logprobs=[p.logprobs[i] for p, i in got],
                   loss_mask=[p.loss_mask[i] for p, i in got],
                   images={iid: images[iid] for m in metas for iid in m.image_ids
                           if iid not in skip_images})
  return read


class CentralizedReads:
  """The baseline behind the on-demand reads' interface (dataplane/reader.py): a
  segment's whole payload is fetched (`fetch(plan)`) when its first micro-batch (or
  its image slots) is asked for; later micro-batches come from what was received."""

  def __init__(self, fetch: Callable[[Sequence[Sequence[TrajMeta]]], list[Payload]]):
    self.fetch = fetch
    self.stats = ReadStats()

  def segment(self, plan: Sequence[Sequence[TrajMeta]], read_images: bool = True):
    return _FetchedSegment(self, [list(m) for m in plan])


class _FetchedSegment:
  def __init__(self, reads: CentralizedReads, plan: list[list[TrajMeta]]):
    self.reads, self.plan, self._payloads = reads, plan, None

  def _fetched(self) -> list[Payload]:
    if self._payloads is None:
      self._payloads = self.reads.fetch(self.plan)
      stats = self.reads.stats
      stats.bytes_read += sum(p.nbytes for p in self._payloads)
      for p in self._payloads:
        stats.rows_read.update(m.id for m in p.metas)
    return self._payloads

  def micro_batch(self, k: int) -> Payload:
    return self._fetched()[k]

  def read(self, metas, skip_images=()) -> Payload:
    """A raw read over the fetched payloads (the encode-once image slots)."""
    return payload_read(self._fetched())(metas, skip_images)


class PipeFetch:
  """A consumer's end of a driver in another process (the benchmarks' baseline): the
  first fetch receives this consumer's slice of the whole train batch, every
  mini-batch, as the driver sent it; later fetches take from it in order. `stats`:
  seconds receiving and unpickling, bytes, and the driver's own time (sent after
  the slice)."""

  def __init__(self, conn):
    self.conn, self.micros, self.stats = conn, None, {}

  def __call__(self, plan):
    if self.micros is None:
      t0 = time.perf_counter()
      data = self.conn.recv_bytes()
      t1 = time.perf_counter()
      self.micros = collections.deque(to_payload(s) for s in deserialize(data))
      self.stats = {"recv_s": t1 - t0, "unpickle_s": time.perf_counter() - t1,
                    "bytes": len(data), "driver_s": self.conn.recv()}
    out = [self.micros.popleft() for _ in plan]
    if [m.id for p in out for m in p.metas] != [m.id for mb in plan for m in mb]:
      raise RuntimeError("the driver's slice is not in this consumer's plan order")
    return out


def send_slices(conn, payload: Payload, plan, started: float) -> int:
  """The driver's side: one consumer's slice (images copied per trajectory),
  pickled and sent, then the seconds since `started`; returns the bytes sent."""
  data = serialize(consumer_slice(payload, plan))
  elapsed = time.perf_counter() - started
  conn.send_bytes(data)
  conn.send(elapsed)
  return len(data)


class PrefetchPipeFetch:
  """The centralized baseline with one step of prefetch (double buffering), the
  strongest simple thing a user of a single-controller stack writes: the driver
  sends each mini-batch's slice as soon as it has gathered it, and a thread here
  receives and unpickles the next mini-batch's slice while the current one computes.
  `stats`: seconds that thread spent receiving and unpickling (raw transfer, mostly
  hidden behind compute), bytes, and the driver's time (after its last slice)."""

  def __init__(self, conn, mini_batches: int):
    self.conn, self.mini_batches = conn, mini_batches
    self.stats = {"recv_s": 0.0, "unpickle_s": 0.0, "bytes": 0, "wait_s": 0.0}
    self._ready = queue.Queue(maxsize=1)  # one mini-batch ahead of compute
    self._thread = threading.Thread(target=self._receive, daemon=True)
    self._thread.start()

  def _receive(self) -> None:
    try:
      for _ in range(self.mini_batches):
        t0 = time.perf_counter()
        data = self.conn.recv_bytes()
        t1 = time.perf_counter()
        micros = [to_payload(s) for s in deserialize(data)]
        self.stats["recv_s"] += t1 - t0
        self.stats["unpickle_s"] += time.perf_counter() - t1
        self.stats["bytes"] += len(data)
        self._ready.put(micros)
      self.stats["driver_s"] = self.conn.recv()
    except Exception as e:  # noqa: BLE001  (handed to the consumer's next fetch)
      self._ready.put(e)

  def __call__(self, plan):
    t0 = time.perf_counter()
    out = self._ready.get()
    self.stats["wait_s"] += time.perf_counter() - t0  # the part of a take spent waiting here
    if isinstance(out, Exception):
      raise RuntimeError(f"the driver's pipe failed: {out!r}") from out
    if [m.id for p in out for m in p.metas] != [m.id for mb in plan for m in mb]:
      raise RuntimeError("the driver's mini-batch slice is not this consumer's plan for it")
    return out

  def close(self) -> None:
    self._thread.join(timeout=60)


def stream_slices(conns: Sequence, store: TrajectoryStore, mini_batch_metas: Sequence,
                  plans: Sequence[Sequence[Sequence[Sequence[TrajMeta]]]], started: float) -> int:
  """The prefetching driver: for each mini-batch, one gather, then each consumer's
  slice pickled and sent (a thread per consumer, so one slow reader does not hold up
  the others); then the seconds since `started`. plans[c][k]: consumer c's
  micro-batches of mini-batch k. Returns (bytes read from the store, bytes sent)."""
  sent, read = [0] * len(conns), 0

  def send(c, payload, k):
    data = serialize(consumer_slice(payload, plans[c][k]))
    conns[c].send_bytes(data)
    sent[c] += len(data)

  for k, metas in enumerate(mini_batch_metas):
    payload = gather(store, metas)
    read += payload.nbytes_read
    threads = [threading.Thread(target=send, args=(c, payload, k)) for c in range(len(conns))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  elapsed = time.perf_counter() - started
  for conn in conns:
    conn.send(elapsed)
  return read, sum(sent)
