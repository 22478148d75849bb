"""The vision task suite (rollout/vision_tasks.py) on a Qwen2-VL / Qwen2.5-VL checkpoint.

    suite = QwenVisionTasks(VisionSpec.from_qwen_checkpoint("/ckpt", image_size=32))
    prompt = suite.prompt(task)     # BOS <vision_start> <image_pad> x k <vision_end> marker SEP
    image = suite.stored_image(task)  # uint8 [S, S, 3]: what the store keeps

Prompts are chat-less token sequences: the task's BOS, one image (its run of k
image-pad tokens, k = the image's merged patches, between vision start and end),
then the task's marker and SEP. The model answers in the task's own tokens.

Token mapping: the tasks' 64 ids (vision_tasks.py: 0 PAD, 1 EOS, 2 BOS, 3-5 markers,
6 SEP, 16-31 digits, 32-37 colour names) are used as ids of the checkpoint's
vocabulary unchanged, so the tasks' verifiers score the model's tokens directly.
That needs a vocabulary of at least 64 ids whose image-pad and vision start / end
ids lie above 63: true of the tiny random checkpoints the tests make
(tests/hf_helpers.py: 96 ids, vision ids 90-93), which have no tokenizer. A real
checkpoint's tokenizer would map the tasks' words instead; `__post_init__` refuses a
vocabulary where the identity map would collide.
"""
from __future__ import annotations

import dataclasses
import functools

import gin
import numpy as np

from knittrans_jax.models import qwen_vl
from knittrans_jax.models.vision_spec import VisionSpec
from knittrans_jax.multimodal.qwen_images import QwenImageInputs
from knittrans_jax.rollout import vision_tasks


@gin.configurable
@dataclasses.dataclass(frozen=True)
class QwenVisionTaskConfig:
  """image_size: the generated images' side in pixels (a multiple of 8, >= 16;
  vision_tasks.make_task), processed at the checkpoint's patch size."""
  image_size: int = 32


@dataclasses.dataclass(frozen=True)
class QwenVisionTasks:
  """The suite's Qwen-VL side over the run's vision spec (models/vision_spec.py)."""
  spec: VisionSpec

  def __post_init__(self):
    if self.spec.qwen is None:
      raise ValueError(f"QwenVisionTasks: the vision spec is {self.spec.kind!r}, not 'qwen_vl'")
    model = self.spec.qwen
    ids = {"image_token_id": model.image_token_id, "vision_start_token_id": self.vision_start,
           "vision_end_token_id": self.vision_end}
    low = {k: v for k, v in ids.items() if v < vision_tasks.VOCAB_SIZE}
    if model.text.vocab_size < vision_tasks.VOCAB_SIZE or low:
      raise ValueError(f"the checkpoint's vocabulary ({model.text.vocab_size} ids, {ids}) cannot "
                       f"take the vision tasks' {vision_tasks.VOCAB_SIZE} ids unchanged: it needs "
                       f">= {vision_tasks.VOCAB_SIZE} ids and the vision ids above "
                       f"{vision_tasks.VOCAB_SIZE - 1} (these are not: {low})")

  @classmethod
  def of(cls, spec: VisionSpec | None) -> "QwenVisionTasks | None":
    """The suite's Qwen side for a Qwen-VL spec; None for no spec or the tiny VLM."""
    return cls(spec) if spec is not None and spec.qwen is not None else None

  @functools.cached_property
  def inputs(self) -> QwenImageInputs:
    return QwenImageInputs(self.spec.qwen, self.spec.processor)

  @property
  def model(self) -> qwen_vl.QwenVLConfig:
    return self.spec.qwen

  @property
  def image_size(self) -> int:
    return self.spec.image_size

  @property
  def vision_start(self) -> int:
    return self.spec.vision_start

  @property
  def vision_end(self) -> int:
    return self.spec.vision_end

  @property
  def grid(self) -> tuple[int, int, int]:
    """The (t, h, w) patches of every generated image."""
    return self.spec.grid

  @property
  def image_tokens(self) -> int:
    return self.inputs.merged(self.grid)

  @property
  def special_ids(self) -> tuple[int, int, int]:
    """The image-pad and vision start / end ids: the sampler never emits them."""
    return (self.model.image_token_id, self.vision_start, self.vision_end)

  @property
  def prompt_len(self) -> int:
    return vision_tasks.PROMPT_LEN + self.image_tokens + 2

  def prompt(self, task: vision_tasks.VisionTask) -> np.ndarray:
    bos, rest = task.prompt[:1], task.prompt[1:]
    image = [self.vision_start] + [self.model.image_token_id] * self.image_tokens + [
        self.vision_end]
    return np.concatenate([bos, np.asarray(image, np.int32), rest]).astype(np.int32)

  @staticmethod
  def stored_image(task: vision_tasks.VisionTask) -> np.ndarray:
    """The task's image as 8-bit RGB, what a data set holds (and what the processor
    takes): 4x fewer bytes than the float32 original."""
    return np.round(np.clip(task.image, 0, 1) * 255).astype(np.uint8)
