"""The policy's vision path as one typed spec, shared by every role.

    spec = VisionSpec.tiny(ViTConfig())                        # the tiny VLM
    spec = VisionSpec.from_qwen_checkpoint("/ckpt", image_size=32)  # Qwen2-VL / 2.5-VL
    model = vlm.make_model(lm_config, spec, nnx.Rngs(0))

The model (models/vlm.py), the trainer's batch layout (job/trainer.py), the rollout
workers and the task suite (rollout/) all read the same spec: which vision model,
what the store keeps per image (`image_shape`) and, for Qwen-VL, the
image processor, the patch grid every generated image has and the ids around an
image's pad tokens. Nothing here depends on rollout/ or multimodal/.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

from knittrans_jax.models import qwen_image_processor as qip
from knittrans_jax.models import qwen_vl
from knittrans_jax.models.checkpoint_io import read_config
from knittrans_jax.models.vit import ViTConfig


@dataclasses.dataclass(frozen=True)
class VisionSpec:
  """Exactly one of `vit` (the tiny VLM: a ViT encoder and projector before the
  decoder) and `qwen` (a Qwen-VL checkpoint's model with its image `processor`).
  image_size: the side of every generated image in pixels."""
  image_size: int
  vit: ViTConfig | None = None
  qwen: qwen_vl.QwenVLConfig | None = None
  processor: qip.QwenImageProcessorConfig | None = None
  vision_start: int = -1  # Qwen-VL: the ids before and after an image's pad tokens
  vision_end: int = -1

  def __post_init__(self):
    if (self.vit is None) == (self.qwen is None):
      raise ValueError("VisionSpec: give exactly one of vit (the tiny VLM) and qwen (a "
                       "Qwen-VL checkpoint's config)")
    if self.vit is not None and self.image_size != self.vit.image_size:
      raise ValueError(f"VisionSpec.image_size = {self.image_size} is not the ViT's "
                       f"image_size {self.vit.image_size}")
    if self.qwen is not None:
      if self.processor is None:
        raise ValueError("VisionSpec: a Qwen-VL spec needs its image processor config")
      if self.image_size < 16 or self.image_size % 8:
        raise ValueError(f"QwenVisionTaskConfig.image_size = {self.image_size} must be a "
                         "multiple of 8 and >= 16")

  @classmethod
  def tiny(cls, vit: ViTConfig) -> VisionSpec:
    return cls(vit.image_size, vit=vit)

  @classmethod
  def from_qwen_checkpoint(cls, path: str, image_size: int, **overrides) -> VisionSpec:
    """The spec of checkpoint `path`: its config.json (overrides: qwen_vl.config_from_hf's)
    and its preprocessor_config.json; without one, transformers' processor at the
    tower's patch, merge and temporal sizes with min_pixels one merge block, so a small
    generated image keeps its size."""
    hf_config = read_config(path)
    model = qwen_vl.config_from_hf(hf_config, **overrides)
    pre = os.path.join(path, "preprocessor_config.json")
    v = model.vision
    if os.path.isfile(pre):
      with open(pre) as f:
        processor = qip.config_from_hf(json.load(f))
    else:
      processor = qip.QwenImageProcessorConfig(
          patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
          merge_size=v.merge, min_pixels=(v.patch_size * v.merge) ** 2)
    return cls(image_size, qwen=model, processor=processor,
               vision_start=int(hf_config.get("vision_start_token_id", 151652)),
               vision_end=int(hf_config.get("vision_end_token_id", 151653)))

  @property
  def kind(self) -> str:
    return "vit" if self.vit is not None else "qwen_vl"

  @property
  def prefix_tokens(self) -> int:
    """Positions an image takes before its row's text: the tiny VLM's projected tokens
    (models/vlm.py); 0 for Qwen-VL, whose image-pad tokens are in the text."""
    return self.vit.num_tokens if self.vit is not None else 0

  @property
  def image_shape(self) -> tuple[int, int, int]:
    """A stored image's shape: float32 [S, S, channels] for the tiny VLM; for Qwen-VL
    the 8-bit RGB image a data set holds (the processor runs at the consumer)."""
    channels = self.vit.channels if self.vit is not None else 3
    return (self.image_size, self.image_size, channels)

  @functools.cached_property
  def grid(self) -> tuple[int, int, int] | None:
    """Qwen-VL: the (t, h, w) patches of every generated image (None for the tiny VLM)."""
    if self.qwen is None:
      return None
    _, grid = qip.preprocess([np.zeros(self.image_shape, np.uint8)], self.processor)
    return tuple(int(v) for v in grid[0])
