"""Image identity: an image is keyed by a hash of its dtype, shape and bytes."""
from __future__ import annotations

import hashlib

import numpy as np

from knittrans_jax.storage.layout import HASH_BYTES, IMAGE_DTYPES, IMG_MAX_NDIM


def image_id(image: np.ndarray) -> str:
  """Content hash (hex) of an image; equal arrays get equal ids in every unit."""
  image = np.ascontiguousarray(image)
  h = hashlib.blake2b(digest_size=HASH_BYTES)
  h.update(f"{image.dtype.str}{image.shape}".encode())
  h.update(memoryview(image).cast("B"))
  return h.hexdigest()


def check_image(image, where: str) -> np.ndarray:
  if not isinstance(image, np.ndarray):
    raise TypeError(f"{where}: an image must be a numpy array, got {type(image).__name__}")
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
