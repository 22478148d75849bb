"""Encode-once for Qwen2-VL / Qwen2.5-VL (models/qwen_vl.py): the mini-batch's unique
images go through the vision tower once, packed; each image-pad token of each
micro-batch takes its row of the tower's output E; one tower VJP per mini-batch.

    iplan = plan_images(plan.consumers, ...)                    # unique images -> owners
    pack = plan_pack(iplan, grids, merge, unit_multiple)        # -> E's rows, static grid
    step = EncodeOnceStep(fns, config, path=QwenVLImages())
    images = jax.device_put(pack.images(pixels), step.images_sharding)
    micro = {**text_fields, **image_fields(tokens, mask, row_images, pack, model_config)}
    grads, sums = step.mini_batch_grads(params, images, micros, total_tokens)

Host side (numpy, pure Python over metadata):
  plan_pack   Lays the unique images out consumer by consumer, as plan_images owns
              them, each consumer's chunk padded with one zero image to the same
              number of merged rows (a multiple of `unit_multiple`), so E and the
              packed pixel_values split evenly over the batch shards and consumer c's
              images land on c's shards. A padding image is its own attention
              segment and no token reads its rows: its cotangent is zero and it adds
              exactly nothing to the gradient.
  image_fields  For one micro-batch: `positions` [B, 3, T] (M-RoPE, from
              qwen_vl.mrope_positions, rows first so they shard like the tokens) and
              `embed_index` [B, T] (the row of E each image-pad token takes; 0 on
              other tokens, which never read it). A run of image-pad tokens that is
              not its image's size is an error naming both counts.
  packed_image_fields  The same for packed rows (job/batching.build_packed_batch):
              each trajectory's M-RoPE positions computed alone and placed at its
              segment, so they restart per segment as the padded row's start at 0.
  QwenImageInputs  Stored uint8 images -> pixel_values at the consumer (why the store
              keeps the image: its docstring); the trainer's encode-once pack of its
              consumers' images and the naive step's per-row fields.
  pack_images   One chunk of unique images, no padding (the rollout sampler's call).
Traced (QwenVLImages, the ImagePath): E = the tower on the packed images; a
micro-batch's logits are QwenVL's with image_embeds = E[embed_index], aligned with
the tokens, whose VJP scatter-adds each token's cotangent into its row of dE.
naive_qwen_forward is the baseline's forward: the tower on every row's own image.

The tower's attention pattern depends on the grid, so the encoder compiles once per
distinct packed grid (images of new sizes, or new paddings, recompile); the backbone
compiles once per micro-batch shape.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from knittrans_jax.models.qwen_image_processor import QwenImageProcessorConfig, preprocess
from knittrans_jax.models.qwen_vl import QwenVLConfig, mrope_positions
from knittrans_jax.multimodal.encode_once import ImagePath
from knittrans_jax.multimodal.image_plan import ImagePlan, ImagePlanError

Grid = tuple[tuple[int, int, int], ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedImages:
  """The tower's input: pixel_values [patches, C*T*P*P] (the pytree's one leaf) and
  image_grid_thw as static metadata (in the treedef, so jit keys on it)."""
  pixel_values: Any
  grid: Grid = dataclasses.field(metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class ImagePack:
  """Where the mini-batch's unique images sit in the packed tower input and in E."""
  ids: tuple[str | None, ...]  # per packed image; None pads
  grid: Grid
  rows: tuple[int, ...]  # each packed image's first row of E
  merge: int
  rows_per_consumer: int

  def merged(self, i: int) -> int:
    t, h, w = self.grid[i]
    return t * h * w // self.merge ** 2

  @property
  def num_rows(self) -> int:
    """Rows of E (merged patches), padding included."""
    return sum(self.merged(i) for i in range(len(self.grid)))

  @property
  def num_unique(self) -> int:
    return sum(i is not None for i in self.ids)

  def where(self, image_id: str) -> tuple[int, int]:
    """(first row of E, merged patches) of an image."""
    i = self.ids.index(image_id)
    return self.rows[i], self.merged(i)

  def images(self, pixels: Mapping[str, np.ndarray], dtype=None) -> PackedImages:
    """The packed tower input from each image's pixel_values [t*h*w, C*T*P*P] (as the
    image processor gives them); padding images are zeros."""
    real = next(iter(pixels.values()))
    dtype = dtype or real.dtype
    parts = []
    for iid, (t, h, w) in zip(self.ids, self.grid):
      if iid is None:
        parts.append(np.zeros((t * h * w, real.shape[1]), dtype))
        continue
      if iid not in pixels:
        raise ImagePlanError(f"no pixel_values for image {iid!r}")
      if pixels[iid].shape != (t * h * w, real.shape[1]):
        raise ImagePlanError(f"image {iid!r}: pixel_values {pixels[iid].shape}, its grid "
                             f"{(t, h, w)} needs {(t * h * w, real.shape[1])}")
      parts.append(np.asarray(pixels[iid], dtype))
    return PackedImages(np.concatenate(parts), self.grid)


def plan_pack(plan: ImagePlan, grids: Mapping[str, Sequence[int]], merge: int,
              unit_multiple: int = 1, min_rows: int = 0,
              consumers: Sequence[int] | None = None) -> ImagePack:
  """Packs plan_images' unique images consumer by consumer (see the module doc).
  `grids` maps an image id to its (t, h, w) in patches; each consumer's chunk is
  padded to the same number of merged rows, at least `min_rows` (one shape for every
  mini-batch: no recompiles) and a multiple of `unit_multiple` (the batch shards per
  consumer). `consumers`: pack only these consumers' images (a trainer of some
  consumers, rows numbered from its first); default all."""
  if unit_multiple < 1 or merge < 1:
    raise ImagePlanError(f"unit_multiple = {unit_multiple} and merge = {merge} must be >= 1")
  chunks = []
  for c in (range(len(plan.owned)) if consumers is None else consumers):
    owned = [i for i in plan.consumer_slots(c) if i is not None]
    chunk = []
    for iid in owned:
      if iid not in grids:
        raise ImagePlanError(f"no image_grid_thw for image {iid!r}")
      t, h, w = (int(v) for v in grids[iid])
      if t < 1 or h < merge or w < merge or h % merge or w % merge:
        raise ImagePlanError(f"image {iid!r}: grid {(t, h, w)} needs t >= 1 and h, w positive "
                             f"multiples of merge = {merge}")
      chunk.append((iid, (t, h, w)))
    chunks.append(chunk)
  used = [sum(t * h * w // merge ** 2 for _, (t, h, w) in ch) for ch in chunks]
  per = max(-(-max(max(used), min_rows, 1) // unit_multiple) * unit_multiple, 1)
  ids, grid, rows, row = [], [], [], 0
  for chunk, n in zip(chunks, used):
    if per > n:  # one padding image of (per - n) merged rows: 1 x merge x (per - n) merges
      chunk = chunk + [(None, (1, merge, merge * (per - n)))]
    for iid, g in chunk:
      ids.append(iid)
      grid.append(g)
      rows.append(row)
      row += g[0] * g[1] * g[2] // merge ** 2
  return ImagePack(tuple(ids), tuple(grid), tuple(rows), merge, per)


def image_fields(tokens, attention_mask, row_images: Sequence[Sequence[str]], pack: ImagePack,
                 config: QwenVLConfig) -> dict[str, np.ndarray]:
  """`positions` int32 [B, 3, T] and `embed_index` int32 [B, T] for one micro-batch
  (module doc). Row b's k-th run of image-pad tokens is the image row_images[b][k]."""
  positions, index, _ = image_positions(tokens, attention_mask, row_images, pack, config)
  return {"positions": np.ascontiguousarray(positions.transpose(1, 0, 2)), "embed_index": index}


def packed_image_fields(tokens, spans: Sequence[tuple[int, int, int]],
                        segment_images: Sequence[Sequence[str]], pack: ImagePack,
                        config: QwenVLConfig) -> dict[str, np.ndarray]:
  """`positions` int32 [B, 3, T] and `embed_index` int32 [B, T] for a packed micro-batch
  `tokens` [B, T]: segment k spans tokens[row, start:end] (spans[k] = (row, start, end),
  job/batching.segment_spans) and holds the images segment_images[k]. Each segment's
  fields are image_fields' for it alone (positions from 0); padding is 0."""
  tokens = np.asarray(tokens)
  B, T = tokens.shape
  if len(segment_images) != len(spans):
    raise ValueError(f"segment_images has {len(segment_images)} entries; there are "
                     f"{len(spans)} segments")
  positions = np.zeros((B, 3, T), np.int32)
  index = np.zeros((B, T), np.int32)
  for (r, a, b), images in zip(spans, segment_images):
    seg = tokens[r:r + 1, a:b]
    try:
      p, i, _ = image_positions(seg, np.ones_like(seg, bool), [images], pack, config)
    except ValueError as e:
      raise ValueError(f"packed row {r}, segment at [{a}, {b}): {e}") from None
    positions[r, :, a:b] = p[:, 0]
    index[r, a:b] = i[0]
  return {"positions": positions, "embed_index": index}


def image_positions(tokens, attention_mask, row_images: Sequence[Sequence[str]],
                    pack: ImagePack, config: QwenVLConfig):
  """(positions [3, B, T], embed_index [B, T], rope_delta [B]), as image_fields (which
  gives the first two rows first) and the sampler's prefill (which needs all three)."""
  tokens = np.asarray(tokens)
  mask = np.asarray(attention_mask).astype(bool)
  B, T = tokens.shape
  if len(row_images) != B:
    raise ValueError(f"row_images has {len(row_images)} rows; tokens have {B}")
  index = np.zeros((B, T), np.int32)
  grid = []
  for b in range(B):
    is_image = (tokens[b] == config.image_token_id) & mask[b]
    edges = np.flatnonzero(np.diff(np.r_[0, is_image.astype(np.int8), 0]))
    runs = list(zip(edges[::2], edges[1::2]))
    if len(runs) != len(row_images[b]):
      raise ValueError(f"row {b}: {len(runs)} run(s) of image-pad tokens (id "
                       f"{config.image_token_id}) but {len(row_images[b])} image(s) "
                       f"{list(row_images[b])}")
    for (i, j), iid in zip(runs, row_images[b]):
      if iid not in pack.ids:
        raise ValueError(f"row {b}: image {iid!r} is not in the mini-batch's pack")
      start, merged = pack.where(iid)
      if j - i != merged:
        raise ValueError(f"row {b}: image {iid!r} has {merged} merged patches (grid "
                         f"{pack.grid[pack.ids.index(iid)]}, merge {pack.merge}) but its run "
                         f"of image-pad tokens at {i} has {j - i}")
      index[b, i:j] = np.arange(start, start + merged)
      grid.append(pack.grid[pack.ids.index(iid)])
  positions, delta = mrope_positions(tokens, np.asarray(grid, np.int64).reshape(-1, 3) if grid
                                     else None, config, mask)
  return positions, index, delta


def pack_images(grids: Mapping[str, Sequence[int]], merge: int) -> ImagePack:
  """All of `grids`' images in one chunk, in order, without padding (the sampler's
  call: one device, each unique image once)."""
  ids, grid, rows, row = [], [], [], 0
  for iid, g in grids.items():
    ids.append(iid)
    grid.append(tuple(int(v) for v in g))
    rows.append(row)
    row += grid[-1][0] * grid[-1][1] * grid[-1][2] // merge ** 2
  return ImagePack(tuple(ids), tuple(grid), tuple(rows), merge, row)


@dataclasses.dataclass(frozen=True)
class QwenImageInputs:
  """Stored images -> the model's inputs, at the consumer (and the rollout worker).

  The store keeps each image as it was made (uint8 [H, W, 3], one byte a pixel
  value), not pixel_values: those are float32 and repeat every patch over the
  temporal_patch_size frames, 8x the bytes of a still image, and the processor is
  deterministic numpy, so both ends derive the same pixel_values from the image."""
  model: QwenVLConfig
  processor: QwenImageProcessorConfig

  def pixels(self, image: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel_values [t*h*w, C*T*P*P], its grid (t, h, w)) of one stored image."""
    pixel_values, grid = preprocess([image], self.processor)
    return pixel_values, tuple(int(v) for v in grid[0])

  def merged(self, grid) -> int:
    t, h, w = grid
    return t * h * w // self.model.vision.merge ** 2

  def prefill(self, tokens, valid, images: Sequence[np.ndarray], index) -> dict:
    """The sampler's prefill inputs (rollout/sampler.py): the U stored `images`
    processed and packed, each row's M-RoPE positions and rope delta, and the image
    rows its pad tokens take (row i holds image index[i])."""
    done = [self.pixels(im) for im in images]
    pack = pack_images({str(u): g for u, (_, g) in enumerate(done)}, self.model.vision.merge)
    positions, embed_index, delta = image_positions(
        tokens, valid, [(str(int(u)),) for u in index], pack, self.model)
    return dict(images=pack.images({str(u): pv for u, (pv, _) in enumerate(done)}, np.float32),
                positions=positions, rope_delta=delta, embed_index=embed_index)

  def encode_once_images(self, plan: ImagePlan, images: Mapping[str, np.ndarray],
                         consumers: Sequence[int], unit_multiple: int, min_rows: int,
                         missing: set) -> tuple[ImagePack, PackedImages]:
    """The pack of `consumers`' images (read: `images`, by id) and its tower input. An
    image in `missing` (not readable) takes its place as zeros of the grid `min_rows`
    allows one image; its rows do not train."""
    pixels, grids = {}, {}
    for c in consumers:
      for iid in plan.consumer_slots(c):
        if iid is None:
          continue
        if iid in images:
          pixels[iid], grids[iid] = self.pixels(images[iid])
        else:
          missing.add(iid)
    for iid in missing:  # a stand-in of some present image's size (none present: 1 merge)
      m = self.model.vision.merge
      grids.setdefault(iid, next(iter(grids.values()), (1, m, m)))
      t, h, w = grids[iid]
      pixels.setdefault(iid, np.zeros((t * h * w, self.model.vision.patch_dim), np.float32))
    pack = plan_pack(plan, grids, self.model.vision.merge, unit_multiple, min_rows, consumers)
    return pack, pack.images(pixels, np.float32) if pixels else PackedImages(
        np.zeros((pack.num_rows * pack.merge ** 2, self.model.vision.patch_dim), np.float32),
        pack.grid)

  def naive_fields(self, tokens, attention_mask, row_images: Sequence[np.ndarray | None],
                   grid: tuple[int, int, int], cache: dict) -> dict[str, np.ndarray]:
    """The naive step's image fields: every row's own pixel_values [B, patches, dim]
    (zeros for a row without an image), M-RoPE `positions` [B, 3, T] and `embed_index`
    [B, T] into the row's own merged patches. `row_images`: each row's image (None:
    none), each of `grid` (the step's static one); `cache` keeps pixel_values by
    id(image) within one payload (a group's rows share its image)."""
    pv = np.zeros((len(row_images), int(np.prod(grid)), self.model.vision.patch_dim), np.float32)
    for b, im in enumerate(row_images):
      if im is None:
        continue
      pixel_values, g = cache.setdefault(id(im), self.pixels(im))
      if g != tuple(grid):
        raise ValueError(f"row {b}: image of shape {im.shape} has grid {g}; the naive Qwen-VL "
                         f"step stacks one image per row, all of grid {tuple(grid)}")
      pv[b] = pixel_values
    own = pack_images({"row": grid}, self.model.vision.merge)
    positions, index, _ = image_positions(
        tokens, attention_mask, [("row",) if im is not None else () for im in row_images], own,
        self.model)
    return {"pixel_values": pv, "positions": np.ascontiguousarray(positions.transpose(1, 0, 2)),
            "embed_index": index}


def naive_qwen_forward(grid: tuple[int, int, int], calls=None):
  """The naive step's forward: the tower on every row's own image (batch
  'pixel_values' [B, patches, dim], each of `grid`), then the decoder. The tower runs
  row by row (vmap), as a system without deduplication runs it: attention within
  each image, no pack across rows."""
  grid = tuple(int(v) for v in grid)

  def forward(model, batch):
    embeds = jax.vmap(lambda x: model.encode(x, (grid,)))(batch["pixel_values"])
    if calls is not None:
      embeds = calls.tag(embeds, embeds.shape[0])
    rows = jnp.take_along_axis(embeds, batch["embed_index"][..., None], axis=1)  # [B, T, width]
    return model(batch["tokens"], batch["attention_mask"],
                 positions=jnp.moveaxis(batch["positions"], 1, 0), image_embeds=rows,
                 hidden=True)
  return forward


@dataclasses.dataclass(frozen=True)
class QwenVLImages(ImagePath):
  """models/qwen_vl.py's QwenVL: PackedImages -> E [merged patches, width]; each
  image-pad token takes E[batch['embed_index']] at M-RoPE batch['positions'] (packed
  rows: within its batch['segment_ids'] segment, packed_image_fields)."""
  merge: int = 2  # the tower's spatial merge (QwenVisionConfig.merge): patches per E row
  encoder_keys = ("visual",)
  images_axes = ("batch", None)
  embeds_axes = ("batch", None)
  index_keys = ("embed_index", "positions")
  packed_index_keys = ("embed_index", "positions", "segment_ids")
  naive_keys = ("pixel_values", "images")

  def encode(self, model, images: PackedImages):
    return model.encode(images.pixel_values, images.grid)

  def logits(self, model, embeds, batch):
    rows = jnp.take(embeds, batch["embed_index"], axis=0)  # [B, T, width], by token
    positions = jnp.moveaxis(batch["positions"], 1, 0)  # [B, 3, T] -> the decoder's [3, B, T]
    return model(batch["tokens"], batch["attention_mask"], positions=positions,
                 image_embeds=rows, segment_ids=batch.get("segment_ids"), hidden=True)

  def num_images(self, images: PackedImages) -> int:
    return len(images.grid)

  def check_images(self, images: PackedImages, shards: int) -> None:
    patches = sum(t * h * w for t, h, w in images.grid)
    got = images.pixel_values.shape[0]
    if got != patches:
      raise ValueError(f"PackedImages: pixel_values has {got} patches; its grid "
                       f"{list(images.grid)} has {patches}")
    rows = patches // self.merge ** 2
    if rows % shards:
      raise ValueError(f"PackedImages: {rows} rows of E ({patches} patches / merge^2) do not "
                       f"split over {shards} batch shards; pass plan_pack a unit_multiple of "
                       "the shards per consumer")
