"""The centralized baseline: how single-controller RL stacks move a train batch.

A driver gathers the whole train batch's payload from the producers' storage
units, builds each consumer's slice as per-trajectory samples (every trajectory
carries its own copy of its image, as a batch repeated n times per prompt does),
serialises the slice with pickle and sends it over a real process boundary (a
pipe). The consumer deserialises it, and only then can compute start.
"""
from __future__ import annotations

import pickle
from typing import Sequence

import numpy as np

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
