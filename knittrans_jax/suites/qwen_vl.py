"""The 'vision' suite on a Qwen2-VL / Qwen2.5-VL checkpoint: the tiny VLM's tasks
(suites/vision.py) as the checkpoint's token sequences (rollout/qwen_vision_tasks.py),
and the trainer's fields for its steps (multimodal/qwen_images.py): encode-once packs
the consumers' unique images for the tower and each micro-batch carries M-RoPE
positions and embed_index; the naive step carries every row's own pixel_values."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from knittrans_jax.models import qwen_vl
from knittrans_jax.multimodal import (PackedImages, QwenImageInputs, QwenVLImages, image_fields,
                                      naive_qwen_forward, packed_image_fields, read_owned_images)
from knittrans_jax.rollout.engine import PromptSpec
from knittrans_jax.rollout.qwen_vision_tasks import QwenVisionTasks
from knittrans_jax.suites.base import BatchFields
from knittrans_jax.suites.vision import VisionSuite


def _row_images(payload, rows: int) -> list:
  return [m.image_ids for m in payload.metas] + [()] * (rows - len(payload.metas))


class QwenPackedImages(BatchFields):
  """Encode-once: this trainer's consumers' unique images, read once each, processed
  and packed for the tower; the pack's shape is fixed by the plan's slots per
  consumer at the run's image grid, so the step does not recompile."""
  shared = True

  def __init__(self, inputs: QwenImageInputs, grid, rows_multiple: int, sharding):
    self.inputs, self.grid, self.rows_multiple, self.sharding = inputs, grid, rows_multiple, sharding

  def check(self, processes: int) -> None:
    if processes > 1:
      raise ValueError(f"{processes} trainer processes: the Qwen-VL steps run in one trainer "
                       "process for now (each process would pack only its consumers' images)")

  def read_shared(self, seg, read, mine):
    plan, images = seg.work.images, {}
    for c in mine:
      images.update(read_owned_images(read, plan, c))
    per_image = self.inputs.merged(self.grid)
    unit = self.rows_multiple // np.gcd(self.rows_multiple, len(mine))
    seg.pack, packed = self.inputs.encode_once_images(
        plan, images, mine, unit, plan.slots_per_consumer * per_image, seg.missing)
    pv = jax.make_array_from_process_local_data(self.sharding, packed.pixel_values)
    return PackedImages(pv, packed.grid)

  def add(self, batch: dict, payload, seg, spans) -> None:
    model = self.inputs.model
    if spans is not None:  # M-RoPE restarting per segment
      batch.update(packed_image_fields(batch["tokens"], spans,
                                       [m.image_ids for m in payload.metas], seg.pack, model))
    else:  # each image-pad token's row of the mini-batch's E
      batch.update(image_fields(batch["tokens"], batch["attention_mask"],
                                _row_images(payload, batch["tokens"].shape[0]), seg.pack, model))


class QwenRowImages(QwenPackedImages):
  """The naive step: every row's own copy of its image's pixel_values."""
  shared = False
  row_images = True

  def add(self, batch: dict, payload, seg, spans) -> None:
    rows = _row_images(payload, batch["tokens"].shape[0])
    batch.update(self.inputs.naive_fields(
        batch["tokens"], batch["attention_mask"],
        [payload.images[r[0]] if r else None for r in rows], self.grid, {}))


@dataclasses.dataclass(frozen=True)
class QwenVLSuite(VisionSuite):
  vocab_size = None  # prompts carry the checkpoint's vision ids

  @functools.cached_property
  def qwen(self) -> QwenVisionTasks:
    return QwenVisionTasks(self.spec)

  def __getstate__(self):  # the cache is rebuilt where the suite is unpickled
    return {k: v for k, v in self.__dict__.items() if k != "qwen"}

  def __setstate__(self, state):
    self.__dict__.update(state)

  def check(self, setup) -> None:
    if setup.evaluation.every_steps:
      raise ValueError("EvalConfig.every_steps: held-out evaluation of a Qwen-VL policy is "
                       "not built yet; set it to 0")

  @property
  def prompt_len(self) -> int:
    return self.qwen.prompt_len

  @property
  def prompt_spec(self) -> PromptSpec:
    return PromptSpec(self.prompt_len, self.qwen.inputs, self.qwen.special_ids)

  def prompt(self, task) -> np.ndarray:
    return self.qwen.prompt(task)

  def stored_image(self, task) -> np.ndarray:
    return self.qwen.stored_image(task)

  def load(self):
    return qwen_vl.load

  def image_path(self):
    return QwenVLImages(self.spec.qwen.vision.merge)

  def forward(self):
    return naive_qwen_forward(self.spec.grid)

  def check_naive(self) -> None:
    pass

  def shared_fields(self, layout, step) -> BatchFields:
    return QwenPackedImages(self.qwen.inputs, self.spec.grid, layout.rows_multiple,
                            step.images_sharding)

  def naive_fields(self, layout) -> BatchFields:
    return QwenRowImages(self.qwen.inputs, self.spec.grid, layout.rows_multiple, None)
