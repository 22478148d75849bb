"""NNX models: the decoder LM (tiny default, or Qwen2/2.5, Qwen3, Llama 3 loaded by
models/hf.py), the ViT encoder and the VLM."""
from knittrans_jax.models.decoder import DecoderConfig, DecoderLM
from knittrans_jax.models.vit import Projector, ViTConfig, ViTEncoder
from knittrans_jax.models.vlm import VLM, vlm_forward

__all__ = ["DecoderConfig", "DecoderLM", "Projector", "VLM", "ViTConfig", "ViTEncoder",
           "vlm_forward"]
