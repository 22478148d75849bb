"""Qwen2-VL / Qwen2.5-VL image preprocessing in numpy (+ Pillow for the resize): images
-> (pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]), as transformers'
Qwen2VLImageProcessorPil makes them, without torch.

Each image is converted to RGB (transparency over white), resized with Pillow's
bicubic filter on uint8 pixels to the `smart_resize` size (both sides multiples of
patch_size * merge_size, the pixel count within [min_pixels, max_pixels]), scaled to
[0, 1], normalised with the CLIP mean and std, and cut into patches in the order
the vision tower reads them (models/qwen_vision.py): merge x merge blocks in raster
order, the patches of a block consecutive, each patch flattened as (C, T, P, P). A
still image is repeated over the temporal_patch_size frames of its one time step.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class QwenImageProcessorConfig:
  """transformers' Qwen2VLImageProcessor defaults; the released checkpoints'
  preprocessor_config.json raise max_pixels to 12845056 (`config_from_hf` reads it)."""
  patch_size: int = 14
  temporal_patch_size: int = 2
  merge_size: int = 2
  min_pixels: int = 56 * 56
  max_pixels: int = 28 * 28 * 1280
  image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
  image_std: tuple[float, ...] = OPENAI_CLIP_STD
  rescale_factor: float = 1 / 255

  def __post_init__(self):
    object.__setattr__(self, "image_mean", tuple(float(x) for x in self.image_mean))
    object.__setattr__(self, "image_std", tuple(float(x) for x in self.image_std))
    for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
      if getattr(self, name) <= 0:
        raise ValueError(f"QwenImageProcessorConfig.{name} = {getattr(self, name)} must be "
                         "positive")
    if self.min_pixels > self.max_pixels:
      raise ValueError(f"QwenImageProcessorConfig: min_pixels {self.min_pixels} > max_pixels "
                       f"{self.max_pixels}")
    if len(self.image_mean) != 3 or len(self.image_std) != 3:
      raise ValueError(f"QwenImageProcessorConfig: image_mean {self.image_mean} and image_std "
                       f"{self.image_std} need one value per RGB channel")

  @property
  def factor(self) -> int:
    return self.patch_size * self.merge_size


def config_from_hf(pre: dict[str, Any]) -> QwenImageProcessorConfig:
  """From a preprocessor_config.json dict: min/max_pixels, or transformers 5's
  size = {shortest_edge, longest_edge} (which are pixel counts here, not edges)."""
  size = pre.get("size") or {}
  d = QwenImageProcessorConfig()
  return QwenImageProcessorConfig(
      patch_size=int(pre.get("patch_size", d.patch_size)),
      temporal_patch_size=int(pre.get("temporal_patch_size", d.temporal_patch_size)),
      merge_size=int(pre.get("merge_size", d.merge_size)),
      min_pixels=int(pre.get("min_pixels", size.get("shortest_edge", d.min_pixels))),
      max_pixels=int(pre.get("max_pixels", size.get("longest_edge", d.max_pixels))),
      image_mean=tuple(pre.get("image_mean", d.image_mean)),
      image_std=tuple(pre.get("image_std", d.image_std)),
      rescale_factor=float(pre.get("rescale_factor", d.rescale_factor)))


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
  """The size the image is resized to: each side rounded to a multiple of `factor`,
  then both scaled by one ratio (floored / ceiled to multiples of `factor`) if the
  area leaves [min_pixels, max_pixels]. Python's round() (half to even), as in Qwen."""
  if min(height, width) <= 0:
    raise ValueError(f"smart_resize: image of {height} x {width} pixels")
  if max(height, width) / min(height, width) > 200:
    raise ValueError(f"smart_resize: aspect ratio {max(height, width) / min(height, width):.1f} "
                     f"of a {height} x {width} image is over 200")
  h = round(height / factor) * factor
  w = round(width / factor) * factor
  if h * w > max_pixels:
    beta = math.sqrt(height * width / max_pixels)
    h = max(factor, math.floor(height / beta / factor) * factor)
    w = max(factor, math.floor(width / beta / factor) * factor)
  elif h * w < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    h = math.ceil(height * beta / factor) * factor
    w = math.ceil(width * beta / factor) * factor
  return h, w


def to_rgb(image) -> Image.Image:
  """A PIL image, or uint8 numpy [H, W] / [H, W, 1|3|4], as an RGB PIL image; an
  alpha channel is composited over white (as transformers 5.20+ does; 5.19, which vLLM
  pins, drops the alpha)."""
  if isinstance(image, np.ndarray):
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or \
        (image.ndim == 3 and image.shape[-1] not in (1, 3, 4)):
      raise ValueError(f"image array of shape {image.shape} and dtype {image.dtype}: expected "
                       "uint8 (H, W) or (H, W, C) with C in 1, 3, 4 (channels last)")
    image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image)
  elif not isinstance(image, Image.Image):
    raise ValueError(f"image of type {type(image).__name__}: expected a PIL image or a uint8 "
                     "numpy array")
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
  return image.convert("RGB")


def patchify(image: np.ndarray, config: QwenImageProcessorConfig) -> np.ndarray:
  """[C, H, W] float32 -> [H/P * W/P, C*T*P*P], merge blocks in raster order."""
  c, height, width = image.shape
  p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
  gh, gw = height // p, width // p
  x = image.reshape(c, gh // m, m, p, gw // m, m, p)
  x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (block h, block w, in h, in w, C, P, P)
  x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (t,) + x.shape[5:])
  return x.reshape(gh * gw, c * t * p * p)


def preprocess(images: Sequence, config: QwenImageProcessorConfig = QwenImageProcessorConfig()
               ) -> tuple[np.ndarray, np.ndarray]:
  """Images (PIL or uint8 numpy, any sizes) -> (pixel_values float32
  [sum of patches, C*T*P*P], image_grid_thw int64 [len(images), 3])."""
  if isinstance(images, (Image.Image, np.ndarray)):
    images = [images]
  if not len(images):
    raise ValueError("preprocess: no images")
  mean = np.asarray(config.image_mean, np.float32)[:, None, None]
  std = np.asarray(config.image_std, np.float32)[:, None, None]
  patches, grids = [], []
  for image in images:
    rgb = to_rgb(image)
    h, w = smart_resize(rgb.height, rgb.width, config.factor, config.min_pixels,
                        config.max_pixels)
    pixels = np.asarray(rgb.resize((w, h), resample=Image.Resampling.BICUBIC))
    # Scaled in float64 and then rounded to float32 (transformers' rescale), so the
    # values match it exactly; normalised in float32.
    x = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    x = (x.transpose(2, 0, 1) - mean) / std
    patches.append(patchify(x, config))
    grids.append((1, h // config.patch_size, w // config.patch_size))
  return np.concatenate(patches).astype(np.float32), np.asarray(grids, np.int64)
