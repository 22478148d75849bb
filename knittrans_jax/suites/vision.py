"""The 'vision' suite on the tiny VLM: one generated image per prompt
(rollout/vision_tasks.py), shared by the group's n responses (the engine encodes it
once, the store keeps it once), and the trainer's image fields for its two steps:
the naive one (the image copied into every row) and encode-once (multimodal/: each
image encoded once per mini-batch from its slot, rows pointing at it).
A Qwen-VL checkpoint runs the same tasks (suites/qwen_vl.py)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from knittrans_jax.data import split
from knittrans_jax.models.vision_spec import VisionSpec
from knittrans_jax.multimodal import (EncodeOnceStep, PrefixImages, check_deterministic,
                                      naive_vlm_forward, read_slot_images)
from knittrans_jax.rollout import vision_tasks
from knittrans_jax.rollout.engine import PromptSpec
from knittrans_jax.suites.base import BatchFields, TaskSuite


class NaiveImages(BatchFields):
  """The naive step: every row carries its own copy of its image."""
  row_images = True

  def __init__(self, image_shape):
    self.image_shape = tuple(image_shape)

  def add(self, batch: dict, payload, seg, spans) -> None:
    images = np.zeros((batch["tokens"].shape[0], *self.image_shape), np.float32)
    for i, m in enumerate(payload.metas):
      images[i] = payload.images[m.image_ids[0]]
    batch["images"] = images


class SlotImages(BatchFields):
  """Encode-once: the mini-batch's image slots, read once; each row's image index
  (packed rows carry theirs already, job/batching.py)."""
  shared = True

  def __init__(self, image_shape, prefix_tokens: int, sharding):
    self.image_shape, self.prefix_tokens, self.sharding = image_shape, prefix_tokens, sharding

  def read_shared(self, seg, read, mine):
    slots = np.concatenate([read_slot_images(read, seg.work.images, c, self.image_shape,
                                             missing=seg.missing) for c in mine])
    return jax.make_array_from_process_local_data(self.sharding, slots)

  def add(self, batch: dict, payload, seg, spans) -> None:
    if spans is None:
      index = np.zeros(batch["tokens"].shape[0], np.int32)  # padding rows: any slot, no loss
      index[:len(payload.metas)] = [seg.slot_of[m.id] for m in payload.metas]
      batch["image_index"] = index


@dataclasses.dataclass(frozen=True)
class VisionSuite(TaskSuite):
  """`spec`: the policy's vision path (models/vision_spec.py), the tiny VLM here."""
  spec: VisionSpec
  name = "vision"
  sources = vision_tasks.SOURCES
  vocab_size = vision_tasks.VOCAB_SIZE

  @property
  def prompt_len(self) -> int:
    return vision_tasks.PROMPT_LEN

  @property
  def image_size(self) -> int:
    return self.spec.image_size

  @property
  def model_vision(self) -> VisionSpec:
    return self.spec

  @property
  def prefix_tokens(self) -> int:
    return self.spec.prefix_tokens

  @property
  def prompt_spec(self) -> PromptSpec:
    return PromptSpec(self.prompt_len)

  def draw(self, rng: np.random.Generator, source: str):
    return vision_tasks.make_task(rng, source, self.image_size)

  def held_out(self, task) -> bool:
    return split.held_out(task.source, task.prompt, task.image)

  def score(self, task, response: np.ndarray) -> float:
    return vision_tasks.score(task, response)

  def stored_image(self, task) -> np.ndarray:
    return task.image

  # -- the model and the trainer ---------------------------------------------------------
  def image_path(self):
    return PrefixImages()

  def forward(self):
    return naive_vlm_forward()

  def check_step(self, setup, model_fn) -> None:
    """A dropout the step cannot keep is refused with the reason, before the model's
    state is built (encoding once would change it; the naive step keeps no rng)."""
    if setup.cfg.encode_once:
      with nnx.use_eager_sharding(False):
        check_deterministic(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))),
                            self.image_path().encoder_keys)
    else:
      self.check_naive()

  def train_parts(self, fns, layout, setup):
    """(BatchFields, the mini-batch step or None): encode-once (JobConfig.encode_once,
    EncodeOnceConfig) or the naive step."""
    if setup.cfg.encode_once:
      step = EncodeOnceStep(fns, setup.encode_once, path=self.image_path())
      return self.shared_fields(layout, step), step
    return self.naive_fields(layout), None

  def check_naive(self) -> None:
    if self.spec.vit.dropout:
      raise ValueError(f"ViTConfig.dropout = {self.spec.vit.dropout}: the trainer keeps no "
                       "dropout rng state; set it to 0")

  def shared_fields(self, layout, step) -> BatchFields:
    return SlotImages(self.spec.image_shape, self.spec.prefix_tokens, step.images_sharding)

  def naive_fields(self, layout) -> BatchFields:
    return NaiveImages(self.spec.image_shape)
