"""A VLM: ViT encoder -> projector -> embeddings placed before the text tokens."""
from __future__ import annotations

from flax import nnx

from knittrans_jax.models.decoder import DecoderConfig, DecoderLM
from knittrans_jax.models.qwen_vl import QwenVL
from knittrans_jax.models.vision_spec import VisionSpec
from knittrans_jax.models.vit import Projector, ViTConfig, ViTEncoder


class VLM(nnx.Module):
  """images [B, H, W, C], tokens [B, T] -> logits [B, T, vocab].

  `encode` and `decode` are exposed separately so that the encoder can run once per
  unique image of a mini-batch (knittrans_jax/multimodal/).
  """

  def __init__(self, vit: ViTConfig, lm: DecoderConfig, rngs: nnx.Rngs):
    self.encoder = ViTEncoder(vit, rngs)
    self.projector = Projector(vit.width, lm.width, rngs, lm.dtype, vit.merge)
    self.decoder = DecoderLM(lm, rngs)

  def encode(self, images):
    """Projected image embeddings [B, num_tokens, lm width]."""
    return self.projector(self.encoder(images))

  def decode(self, image_embeds, tokens, attention_mask, hidden: bool = False):
    """hidden: the decoder's `Hidden` (the train step's chunked log-probs) for logits."""
    return self.decoder(tokens, attention_mask, prefix=image_embeds, hidden=hidden)

  # -- incremental decoding (the rollout sampler) -----------------------------
  def prefill(self, tokens, valid, capacity: int, images=None, image_index=None):
    """The decoder's prefill with the image embeddings as prefix. `image_index` [B]
    picks each row's image from `images` [U, ...], so a group's n responses encode
    their shared image once."""
    embeds = self.encode(images)
    if image_index is not None:
      embeds = embeds[image_index]
    return self.decoder.prefill(tokens, valid, capacity, prefix=embeds)

  def decode_step(self, token, position, caches, index, key_valid):
    return self.decoder.decode_step(token, position, caches, index, key_valid)

  def __call__(self, images, tokens, attention_mask, hidden: bool = False):
    return self.decode(self.encode(images), tokens, attention_mask, hidden)


def vlm_forward(model, batch):
  """The train step's forward: hidden states, so no [B, T, vocab] logits are formed."""
  return model(batch["images"], batch["tokens"], batch["attention_mask"], hidden=True)


def make_model(lm: DecoderConfig, vision: VisionSpec | None, rngs: nnx.Rngs) -> nnx.Module:
  """The policy: the text decoder without a vision spec, the VLM above for the tiny
  one, the Qwen-VL model (with the checkpoint's own decoder) for a Qwen-VL one."""
  if vision is None:
    return DecoderLM(lm, rngs)
  if not isinstance(vision, VisionSpec):
    raise TypeError(f"make_model: vision = {type(vision).__name__}; pass a VisionSpec "
                    "(models/vision_spec.py) or None")
  if vision.vit is not None:
    return VLM(vision.vit, lm, rngs)
  return QwenVL(vision.qwen, rngs)
