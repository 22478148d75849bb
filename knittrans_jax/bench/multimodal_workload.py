"""What scripts/bench_multimodal.py trains on: a store on disk of image groups (one
image per prompt, stored once), the tiny VLM's configs or a Qwen-VL checkpoint's vision
inputs, and the model's forward FLOPs."""
from __future__ import annotations

import numpy as np

VOCAB = 64


def qwen_suite(a):
  """--model's vision inputs (rollout/qwen_vision_tasks.py), or None (the tiny VLM)."""
  if not a.model:
    return None
  from knittrans_jax.models.vision_spec import VisionSpec
  from knittrans_jax.rollout.qwen_vision_tasks import QwenVisionTasks
  return QwenVisionTasks(VisionSpec.from_qwen_checkpoint(a.model, a.image))


def build_store(root, args, seed=0):
  from knittrans_jax.storage import Image, StoreSchema, TrajectoryStore
  from knittrans_jax.types import GroupInfo, MiniBatch, Trajectory
  rng = np.random.default_rng(seed)
  qwen = qwen_suite(args)
  store = TrajectoryStore.create("file://" + root, StoreSchema(
      sources=("vqa",), max_prompt_len=args.seq + (qwen.prompt_len if qwen else 0),
      max_response_len=args.seq))
  writers = [store.writer(f"producer{p}", host=f"host{p % 2}") for p in range(4)]
  batches = []
  for k in range(args.mini_batches):
    groups = []
    for g in range(args.prompts):
      gid = k * args.prompts + g
      P = args.seq // 4
      prompt = rng.integers(2, VOCAB, P, dtype=np.int32)
      if qwen is None:
        img = Image.of(rng.random((args.image, args.image, 3), dtype=np.float32))
      else:  # a uint8 image as a data set holds it; its image-pad run before the text
        img = Image.of(rng.integers(0, 256, (args.image, args.image, 3), dtype=np.uint8))
        prompt = np.concatenate([[qwen.vision_start], [qwen.model.image_token_id] *
                                 qwen.image_tokens, [qwen.vision_end], prompt]).astype(np.int32)
      trajs = []
      for i in range(args.n):
        R = int(np.clip(rng.lognormal(np.log(args.seq / 2), 0.4), 4, args.seq - P))
        trajs.append(Trajectory(prompt_tokens=prompt,
                                response_tokens=rng.integers(2, VOCAB, R, dtype=np.int32),
                                logprobs=-rng.uniform(3.5, 4.5, R).astype(np.float32),
                                loss_mask=np.ones(R, bool), reward=float(rng.random()),
                                source="vqa", group_id=gid, index_in_group=i, versions=(0,),
                                image_ids=(img.id,)))
      metas = writers[gid % len(writers)].append(trajs, images=[img])
      groups.append(GroupInfo(gid, "vqa", sum(m.length for m in metas), 0,
                              rewards=tuple(m.reward for m in metas), metas=tuple(metas)))
    batches.append(MiniBatch(0, k, tuple(groups), 0))
  return store, batches


def vlm_configs(a):
  from knittrans_jax.models import DecoderConfig, ViTConfig
  vit = ViTConfig(image_size=a.image, patch_size=a.patch, width=a.vit_width, depth=2, heads=4,
                  mlp_width=2 * a.vit_width, merge=a.merge)
  lm = DecoderConfig(vocab_size=VOCAB, width=a.lm_width, depth=2, heads=4, mlp_width=2 * a.lm_width)
  return vit, lm


def model_flops(a) -> dict:
  """Forward FLOPs from XLA's cost analysis: the encoder (ViT + projector) on one
  image, the backbone (decoder with the image tokens as prefix) on one row. The
  encoder's share of the naive step's compute is about e / (e + b) (backward ~ 2x
  forward for both)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from knittrans_jax.models.vlm import VLM
  vit, lm = vlm_configs(a)
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: VLM(vit, lm, nnx.Rngs(0))), nnx.Param)

  def flops(fn, *args):
    cost = jax.jit(fn).lower(params, *args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
  e = flops(lambda p, x: nnx.merge(graphdef, p).encode(x),
            jax.ShapeDtypeStruct((1, a.image, a.image, 3), jnp.float32))
  b = flops(lambda p, x, t, m: nnx.merge(graphdef, p).decode(x, t, m),
            jax.ShapeDtypeStruct((1, vit.num_tokens, lm.width), jnp.float32),
            jax.ShapeDtypeStruct((1, a.seq), jnp.int32), jax.ShapeDtypeStruct((1, a.seq), jnp.bool_))
  return {"encoder_fwd_per_image": e, "backbone_fwd_per_row": b, "encoder_share_naive": e / (e + b),
          "vit_tokens": vit.num_patches, "lm_image_tokens": vit.num_tokens}
