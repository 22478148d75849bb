"""Image identity: an image is keyed by a 128-bit hash of its dtype, shape and bytes.

The hash is xxh3-128, many times faster than the blake2b-128 it replaced and
cheaper than copying the image (figures: scripts/bench_image_hash.py,
docs/storage.md). It is not cryptographic: ids detect accidental damage and swaps, and
deduplicate images within a run, but someone who controls the images can make
two different ones share an id (docs/storage.md, "Integrity").

An image is hashed once, where it is made: `Image.of(array)` carries the id with
the array into `UnitWriter.append`, which trusts it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import xxhash

from knittrans_jax.storage.layout import IMAGE_DTYPES, IMG_MAX_NDIM


def _header(image: np.ndarray) -> bytes:
  return f"{image.dtype.str}{image.shape}".encode()


def image_id(image: np.ndarray) -> str:
  """Content hash (hex) of an image; equal arrays get equal ids in every unit."""
  image = np.ascontiguousarray(image)
  h = xxhash.xxh3_128(_header(image))
  h.update(memoryview(image).cast("B"))
  return h.hexdigest()


@dataclasses.dataclass(frozen=True, eq=False)  # eq would compare arrays elementwise
class Image:
  """An image and its id, hashed once where the image is made.

  Pass it to `UnitWriter.append(..., images=[...])`: the writer stores the id as
  given, without hashing again. An array changed after its id was made is stored
  under the wrong id; the first read of it fails (its hash disagrees with the id).
  """
  id: str
  array: np.ndarray

  @classmethod
  def of(cls, array: np.ndarray) -> "Image":
    array = np.ascontiguousarray(array)
    return cls(image_id(array), array)


def check_image(image, where: str) -> np.ndarray:
  if not isinstance(image, np.ndarray):
    raise TypeError(f"{where}: an image must be a numpy array or a storage Image, got "
                    f"{type(image).__name__}")
  if image.dtype not in IMAGE_DTYPES:
    raise TypeError(f"{where}: image dtype {image.dtype} not supported; use one of "
                    f"{[str(d) for d in IMAGE_DTYPES]}")
  if not 1 <= image.ndim <= IMG_MAX_NDIM or image.size == 0:
    raise ValueError(f"{where}: image shape {image.shape} must have 1..{IMG_MAX_NDIM} "
                     "non-empty dimensions")
  if image.dtype.kind == "f" and not np.isfinite(image).all():
    raise ValueError(f"{where}: image holds NaN or inf")
  return np.ascontiguousarray(image)


def hash_to_hex(row: np.ndarray) -> str:
  return bytes(row.astype(np.uint8)).hex()


def hex_to_hash(hex_id: str) -> np.ndarray:
  return np.frombuffer(bytes.fromhex(hex_id), dtype=np.uint8)
