"""Multimodal encoding deduplication: plan the mini-batch's unique images, encode
each once, accumulate embedding cotangents, back-propagate the encoder once."""
from knittrans_jax.multimodal.encode_once import (EncodeOnceConfig, EncodeOnceStep, EncoderCalls,
                                                   ImagePath, PrefixImages, StochasticEncoderError,
                                                   check_deterministic, naive_vlm_forward)
from knittrans_jax.multimodal.image_plan import ImagePlan, ImagePlanError, plan_images
from knittrans_jax.multimodal.qwen_images import (ImagePack, PackedImages, QwenImageInputs,
                                                   QwenVLImages, image_fields, image_positions,
                                                   naive_qwen_forward, pack_images,
                                                   packed_image_fields, plan_pack)
from knittrans_jax.multimodal.slot_reads import (read_owned_images, read_slot_images,
                                                 slots_from_images)
