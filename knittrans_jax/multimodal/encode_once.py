"""The encode-once step: each unique image of a mini-batch is encoded once and its
encoder back-propagates once, giving exactly the naive gradient.

    step = EncodeOnceStep(fns, EncodeOnceConfig())  # fns: train.StepFunctions of a VLM
    enc = step.encode(state.params, images)         # E [U, patches, d] for the U slots
    acc, acc_e = fns.zero_grads(state.params), step.zero_embed_grads(enc)
    for micro in micro_batches:                     # arrive one at a time (data path)
      acc, acc_e, sums = step.backbone(state.params, enc, acc, acc_e, micro, total_tokens)
    acc = step.encoder_grads(state.params, images, enc, acc, acc_e)   # one encoder VJP
    state, metrics = fns.apply_step(state, acc)

A backbone micro-batch gathers its rows' embeddings, E[image_index]; the gradient of
that gather w.r.t. E is a scatter-add, so `acc_e` (fp32, sharded like E) collects
every row's embedding cotangent over all micro-batches. The encoder VJP is linear
in its cotangent, so one VJP of the summed cotangent equals the sum of the per-row
VJPs of the naive step (encoder run per trajectory per micro-batch).

Residuals (EncodeOnceConfig.residuals):
  keep       `encode` runs jax.vjp and returns the VJP closure with E: the encoder's
             activations for the U images stay alive until `encoder_grads`.
  recompute  `encode` runs the forward only; `encoder_grads` runs it again inside
             jax.vjp (GradCache style): one extra encoder forward, no activations held
             across the backbone micro-batches.
Both need the encoder to compute the same function at both times, hence the
determinism guard (dropout refused).

Models: an ImagePath says how a VLM's images reach its backbone (what is encoded,
how a micro-batch finds its rows' embeddings, the layouts of both). PrefixImages
(the default) is models/vlm.py's toy VLM: image slots [U, H, W, C] -> E [U, tokens,
d], a row's slot placed before its text. multimodal/qwen_images.QwenVLImages is
Qwen2-VL / Qwen2.5-VL's: the unique images packed for the tower -> E [merged
patches, d], each image-pad token taking its row of E, M-RoPE positions from the host.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterable

import gin
import jax
import jax.numpy as jnp
from flax import nnx

from knittrans_jax.mesh import batch_size_multiple, logical_sharding, replicated
from knittrans_jax.models.layers import wide
from knittrans_jax.models.vlm import vlm_forward
from knittrans_jax.train.batch import batch_shardings
from knittrans_jax.train.step import StepFunctions

ENCODER_KEYS = ("encoder", "projector")  # the toy VLM's image path: ViT, then projector


class StochasticEncoderError(ValueError):
  """The encoder is not deterministic, so encoding once would change the gradient."""


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EncodeOnceConfig:
  residuals: str = "keep"  # or 'recompute' (see the module doc for the memory trade)
  count_calls: bool = False  # count encoder forwards/backwards at run time (host callbacks)

  def __post_init__(self):
    if self.residuals not in ("keep", "recompute"):
      raise ValueError(f"EncodeOnceConfig.residuals = {self.residuals!r}: use 'keep' or "
                       "'recompute'")


class EncoderCalls:
  """Run-time tallies of images through the encoder, from host callbacks in the
  compiled step (so they count executions, not traces)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.reset()

  def reset(self):
    self.forward_images = self.backward_images = 0
    self.forward_calls = self.backward_calls = 0

  def _forward(self, n):
    with self._lock:
      self.forward_calls += 1
      self.forward_images += int(n)

  def _backward(self, n):
    with self._lock:
      self.backward_calls += 1
      self.backward_images += int(n)

  def tag(self, embeds, n: int | None = None):
    """Identity on the encoder's output whose forward and backward tick the tallies by
    `n` images (default: E's leading dim, one image per row of E)."""
    n = embeds.shape[0] if n is None else n

    @jax.custom_vjp
    def ident(x):
      jax.debug.callback(self._forward, n)
      return x

    def fwd(x):
      jax.debug.callback(self._forward, n)
      return x, None

    def bwd(_, g):
      jax.debug.callback(self._backward, n)
      return (g,)

    ident.defvjp(fwd, bwd)
    return ident(embeds)

  def as_dict(self) -> dict:
    return {"forward_images": self.forward_images, "forward_calls": self.forward_calls,
            "backward_images": self.backward_images, "backward_calls": self.backward_calls}


def split_encoder(params, keys: tuple[str, ...] = ENCODER_KEYS):
  """(the image path's params, the rest) of a VLM's nnx.State, same nesting; `keys`
  are the image path's top-level modules (ImagePath.encoder_keys)."""
  return nnx.split_state(params, lambda path, _: path[0] in keys, ...)


def join(*parts):
  return nnx.merge_state(*parts)


def check_deterministic(model: nnx.Module, keys: tuple[str, ...] = ENCODER_KEYS) -> None:
  """Refuses an image path (the submodules `keys`, ImagePath.encoder_keys) with active
  dropout (or anything else drawing rngs)."""
  for name in keys:
    sub = getattr(model, name, None)
    if sub is None:
      raise StochasticEncoderError(f"model has no '{name}' submodule; the encode-once step "
                                   f"needs a VLM with {keys}")
    for path, module in nnx.iter_modules(sub):
      where = ".".join(str(p) for p in (name, *path))
      if isinstance(module, nnx.Dropout) and module.rate > 0 and not module.deterministic:
        raise StochasticEncoderError(
            f"{where} is dropout with rate {module.rate}: a stochastic encoder gives a "
            "different embedding each time, so one encode per image would not equal the naive "
            "gradient. Set the encoder's dropout to 0 (ViTConfig.dropout for the toy "
            "ViT) or use the naive step.")
      if isinstance(module, nnx.Rngs):
        raise StochasticEncoderError(f"{where} holds an rng stream; the encoder must be "
                                     "deterministic within a mini-batch")


def naive_vlm_forward(calls: EncoderCalls | None = None):
  """The naive forward: the encoder runs on batch['images'], one image per row."""

  if calls is None:
    return vlm_forward

  def forward(model, batch):
    embeds = calls.tag(model.encode(batch["images"]))
    return model.decode(embeds, batch["tokens"], batch["attention_mask"], hidden=True)
  return forward


class ImagePath:
  """How a VLM's images reach its backbone, for EncodeOnceStep. Subclasses set the
  class attributes and define `encode` and `logits` (traced inside the step); they
  are frozen dataclasses, equal when they compute the same thing (a static jit key)."""
  encoder_keys: tuple[str, ...]  # top-level modules of the image path (get the encoder VJP)
  images_axes: tuple  # logical axes of the images' array
  embeds_axes: tuple  # logical axes of E
  index_keys: tuple[str, ...]  # micro-batch fields that find each row's embeddings in E
  packed_index_keys: tuple[str, ...] = ()  # the same for packed rows (segment_ids present)
  naive_keys: tuple[str, ...]  # the naive step's image fields (must not come here)

  def encode(self, model, images):
    """E, the encoder's output for the mini-batch's unique images."""
    raise NotImplementedError

  def logits(self, model, embeds, batch):
    """The backbone's output for one micro-batch, its rows' embeddings taken from E:
    logits, or the decoder's `Hidden` (what the paths here return, so the loss's
    chunked log-probs never form [B, T, vocab])."""
    raise NotImplementedError

  def num_images(self, images) -> int:
    """Images in one encoder call (for EncoderCalls): one per leading row."""
    return jax.tree.leaves(images)[0].shape[0]

  def check_images(self, images, shards: int) -> None:
    """A named error where jit would refuse the layout: the images' leading dim must
    split over the batch shards."""
    n = jax.tree.leaves(images)[0].shape[0]
    if n % shards:
      raise ValueError(f"the mini-batch's images have {n} rows, which do not split over "
                       f"{shards} batch shards; pad them (plan_images' slot_multiple)")


@dataclasses.dataclass(frozen=True)
class PrefixImages(ImagePath):
  """models/vlm.py's VLM: slots [U, H, W, C] -> E [U, tokens, d]; each row's slot
  (batch['image_index'] [B]) goes before its text tokens. Packed rows
  (job/batching.build_packed_batch) carry instead `embed_index` [B, T]: the row of E
  flattened to [U * tokens, d] each image position takes (-1 on text), so every
  segment has its own image before its text, at positions restarting per segment."""
  encoder_keys = ENCODER_KEYS
  images_axes = ("batch", None, None, None)
  embeds_axes = ("batch", None, None)
  index_keys = ("image_index",)
  packed_index_keys = ("embed_index", "segment_ids", "positions")
  naive_keys = ("images",)

  def encode(self, model, images):
    return model.encode(images)

  def logits(self, model, embeds, batch):
    if "segment_ids" in batch:
      flat = embeds.reshape(-1, embeds.shape[-1])
      index = batch["embed_index"]
      rows = jnp.take(flat, jnp.maximum(index, 0), axis=0)  # VJP: scatter-add into dE
      x = jnp.where((index >= 0)[..., None], rows.astype(flat.dtype),
                    model.decoder.embed(batch["tokens"]).astype(flat.dtype))
      return model.decoder(batch["tokens"], batch["attention_mask"], positions=batch["positions"],
                           segment_ids=batch["segment_ids"], embeds=x, hidden=True)
    prefix = jnp.take(embeds, batch["image_index"], axis=0)  # its VJP: scatter-add into dE
    return model.decode(prefix, batch["tokens"], batch["attention_mask"], hidden=True)


@dataclasses.dataclass
class Encoded:
  """What `encode` hands the rest of the mini-batch."""
  embeds: jax.Array  # E, sharded over the batch axes like the images
  residuals: Any  # the encoder's VJP closure ('keep') or None ('recompute')


def _backbone(fns: StepFunctions, path: ImagePath, params, embeds, acc, acc_e, batch,
              total_tokens):
  """One backbone micro-batch (traced). A module function of static (fns, path): it
  depends on neither the residual mode nor the tallies, so every step over the same
  StepFunctions and path (both modes, counted or not) shares its compiled form."""
  enc, rest = split_encoder(params, path.encoder_keys)

  def loss_fn(rest_p, e):
    model = nnx.merge(fns.graphdef, join(enc, rest_p))
    # The path gathers the rows' embeddings from E; the gather's VJP scatter-adds into dE.
    loss_sum, sums = fns.objective_sum(path.logits(model, e, batch), batch)
    return loss_sum / total_tokens, sums

  (_, sums), (g_rest, g_e) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
      rest, embeds)
  acc_enc, acc_rest = split_encoder(acc, path.encoder_keys)
  acc_rest = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc_rest, g_rest)
  return join(acc_enc, acc_rest), acc_e + g_e.astype(acc_e.dtype), sums


class EncodeOnceStep:
  """The deduplicated mini-batch step around a VLM's StepFunctions (see module doc)."""

  def __init__(self, fns: StepFunctions, config: EncodeOnceConfig,
               calls: EncoderCalls | None = None, path: ImagePath | None = None):
    """`config`: the run's (JobSetup.encode_once), built at the root."""
    self.fns = fns
    self.config = config
    self.path = path = path if path is not None else PrefixImages()
    self.calls = calls if calls is not None else (EncoderCalls() if config.count_calls else None)
    # A stochastic encoder never gets here: its rng state cannot be split into a
    # params-only train state. Callers check the model first (check_deterministic).
    mesh, rules = fns.mesh, fns.rules
    self.images_sharding = logical_sharding(mesh, rules, *path.images_axes)
    self.embeds_sharding = logical_sharding(mesh, rules, *path.embeds_axes)
    self._shards = batch_size_multiple(mesh, rules)
    self._param_sh = fns.shardings.params
    self._jitted: dict = {}
    self._zero_e = jax.jit(lambda e: jnp.zeros(e.shape, wide(e.dtype)),
                           in_shardings=(self.embeds_sharding,), out_shardings=self.embeds_sharding)
    if config.residuals == "keep":
      # The VJP closure is a pytree of residual arrays; their layout is left to XLA.
      self._encode = jax.jit(self._encode_keep, in_shardings=(self._param_sh, self.images_sharding))
      self._finish = jax.jit(self._finish_keep, in_shardings=(
          None, self._param_sh, self.embeds_sharding), out_shardings=self._param_sh,
          donate_argnums=1)
    else:
      self._encode = jax.jit(self._encode_only, in_shardings=(self._param_sh, self.images_sharding),
                             out_shardings=self.embeds_sharding)
      self._finish = jax.jit(self._finish_recompute, in_shardings=(
          self._param_sh, self.images_sharding, self._param_sh, self.embeds_sharding),
          out_shardings=self._param_sh, donate_argnums=2)

  # -- traced pieces ------------------------------------------------------------
  def _split(self, params):
    return split_encoder(params, self.path.encoder_keys)

  def _encoder_fn(self, params, images):
    """enc params -> E, with the rest of the model held fixed."""
    _, rest = self._split(params)

    def f(enc):
      embeds = self.path.encode(nnx.merge(self.fns.graphdef, join(enc, rest)), images)
      if self.calls is not None:
        embeds = self.calls.tag(embeds, self.path.num_images(images))
      return jax.lax.with_sharding_constraint(embeds, self.embeds_sharding)
    return f

  def _encode_only(self, params, images):
    enc, _ = self._split(params)
    return self._encoder_fn(params, images)(enc)

  def _encode_keep(self, params, images):
    enc, _ = self._split(params)
    return jax.vjp(self._encoder_fn(params, images), enc)

  def _merge_encoder_grads(self, acc, g_enc):
    acc_enc, acc_rest = self._split(acc)
    acc_enc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc_enc, g_enc)
    return join(acc_enc, acc_rest)

  def _finish_keep(self, vjp_fn, acc, acc_e):
    (g_enc,) = vjp_fn(acc_e)  # E is float32 in these models, like the accumulator
    return self._merge_encoder_grads(acc, g_enc)

  def _finish_recompute(self, params, images, acc, acc_e):
    enc, _ = self._split(params)
    _, vjp_fn = jax.vjp(self._encoder_fn(params, images), enc)
    (g_enc,) = vjp_fn(acc_e)
    return self._merge_encoder_grads(acc, g_enc)


  # -- entry points ---------------------------------------------------------------
  def encode(self, params, images) -> Encoded:
    """Encoder forward on the mini-batch's unique images, once per image (the toy VLM's
    slots [U, H, W, C]; Qwen-VL's qwen_images.PackedImages)."""
    self.path.check_images(images, self._shards)
    if self.config.residuals == "keep":
      embeds, vjp_fn = self._encode(params, images)
      return Encoded(embeds, vjp_fn)
    return Encoded(self._encode(params, images), None)

  def zero_embed_grads(self, encoded: Encoded):
    return self._zero_e(encoded.embeds)

  def backbone(self, params, encoded: Encoded, acc, acc_e, batch: dict, total_tokens):
    """One backbone micro-batch: adds its parameter gradients into `acc` and its
    embedding cotangents into `acc_e` (both donated). The path's index fields (the
    toy VLM's `image_index` [B], each row's slot in E) find the rows' embeddings."""
    index, naive = self.path.index_keys, self.path.naive_keys
    if "segment_ids" in batch:
      index = self.path.packed_index_keys or index
    if any(k not in batch for k in index) or any(k in batch for k in naive):
      raise ValueError(f"an encode-once micro-batch carries {list(index)} (where its rows' "
                       f"embeddings sit in the mini-batch's E) and none of {list(naive)}; got "
                       f"keys {sorted(batch)}")
    key = tuple(sorted((k, v.shape) for k, v in batch.items())) + (encoded.embeds.shape,)
    if key not in self._jitted:
      repl = replicated(self.fns.mesh)
      self._jitted[key] = jax.jit(
          _backbone, static_argnums=(0, 1),
          in_shardings=(self._param_sh, self.embeds_sharding, self._param_sh,
                        self.embeds_sharding,
                        batch_shardings(self.fns.mesh, self.fns.rules, batch), repl),
          out_shardings=(self._param_sh, self.embeds_sharding, repl), donate_argnums=(4, 5))
    return self._jitted[key](self.fns, self.path, params, encoded.embeds, acc, acc_e, batch,
                             jnp.float32(total_tokens))

  def encoder_grads(self, params, images, encoded: Encoded, acc, acc_e):
    """The one encoder VJP of the mini-batch; returns `acc` with the encoder and
    projector gradients added (`acc` is donated)."""
    if self.config.residuals == "keep":
      return self._finish(encoded.residuals, acc, acc_e)
    return self._finish(params, images, acc, acc_e)

  def mini_batch_grads(self, params, images, micro_batches: Iterable[dict], total_tokens,
                       on_dispatch=None):
    """Gradient of one mini-batch (the loop of the module doc) and its metric sums:
    what the trainer runs (job/trainer.py). `micro_batches` may be a generator that
    reads each one as it is asked for; `on_dispatch(acc_e)` is called after each
    backbone call is dispatched (the trainer waits on it before blocking for data)."""
    encoded = self.encode(params, images)
    acc, acc_e = self.fns.zero_grads(params), self.zero_embed_grads(encoded)
    sums = None
    for batch in micro_batches:
      acc, acc_e, s = self.backbone(params, encoded, acc, acc_e, batch, total_tokens)
      sums = s if sums is None else self.fns.add_sums(sums, s)
      if on_dispatch is not None:
        on_dispatch(acc_e)
    return self.encoder_grads(params, images, encoded, acc, acc_e), sums
