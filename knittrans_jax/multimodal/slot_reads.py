"""One consumer's image slots of a mini-batch as a [S, H, W, C] array (or, for
images of any size, by id): each owned image read once, from the storage unit that
holds it; padding slots are zero."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from knittrans_jax.multimodal.image_plan import ImagePlan
from knittrans_jax.types import Payload, TrajMeta


def slots_from_images(plan: ImagePlan, consumer: int, images: dict, image_shape,
                      dtype=np.float32, missing: set | None = None) -> np.ndarray:
  """This consumer's slots from images already at hand (id -> array). An image not
  at hand is an error, unless `missing` is given: then its slot stays zero and its
  id is added there (the caller skips the rows that use it)."""
  ids = plan.consumer_slots(consumer)
  out = np.zeros((len(ids), *image_shape), dtype)
  for s, iid in enumerate(ids):
    if iid is None:
      continue
    if iid not in images:
      if missing is not None:
        missing.add(iid)
        continue
      raise KeyError(f"slot {s} of consumer {consumer} holds image {iid}, which was not read")
    image = images[iid]
    if image.shape != tuple(image_shape):
      raise ValueError(f"image {iid} has shape {image.shape}; the encoder takes {tuple(image_shape)}")
    out[s] = image
  return out


def read_slot_images(read: Callable[[Sequence[TrajMeta], set], Payload], plan: ImagePlan,
                     consumer: int, image_shape, dtype=np.float32,
                     missing: set | None = None) -> np.ndarray:
  """One batched read of the images `consumer` owns (plus the small sequence records
  of the rows that locate them; no other image). `read(metas, skip_images)` is a
  store's read, or a QuarantiningReader's: then an image of a damaged unit is not
  returned and, with `missing` given, its slot stays zero (see slots_from_images)."""
  return slots_from_images(plan, consumer, read_owned_images(read, plan, consumer), image_shape,
                           dtype, missing)


def read_owned_images(read: Callable[[Sequence[TrajMeta], set], Payload], plan: ImagePlan,
                      consumer: int) -> dict:
  """{image id: array} of the images `consumer` owns, in one batched read (as
  read_slot_images; an image of a quarantined unit is left out)."""
  owned = plan.owned[consumer]
  if not owned:
    return {}
  others = set(plan.source) - set(owned)
  return read([plan.source[i] for i in owned], others).images
