"""Tiny, randomly initialised NNX models: decoder LM, ViT encoder, VLM."""
from knittrans_jax.models.decoder import DecoderConfig, DecoderLM
from knittrans_jax.models.vit import Projector, ViTConfig, ViTEncoder
from knittrans_jax.models.vlm import VLM, vlm_forward

__all__ = ["DecoderConfig", "DecoderLM", "Projector", "VLM", "ViTConfig", "ViTEncoder",
           "vlm_forward"]
