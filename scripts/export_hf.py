"""Turns a run's Orbax checkpoint into a Hugging Face directory (transformers, vLLM
and SGLang load it).

  python scripts/export_hf.py --workdir runs/math_grpo --out exports/math_grpo_step40
  python scripts/export_hf.py --workdir runs/NAME --out DIR --step 20 --dtype bfloat16

The run's operative config (WORKDIR/operative_config.gin) rebuilds the model and the
optimizer, so only the checkpoint's shapes are needed: nothing is initialised. The
tokenizer files of the run's checkpoint (or MathTaskConfig.tokenizer) are copied
alongside, so the directory is complete.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

from knittrans_jax import cli

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def export(workdir: str, out: str, step: int | None = None, dtype: str | None = None) -> dict:
  import gin
  from flax import nnx

  from knittrans_jax import gin_cli
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax import suites
  from knittrans_jax.models import DecoderConfig, hf
  from knittrans_jax.models.vlm import make_model
  from knittrans_jax.rollout.math_tasks import MathTaskConfig
  from knittrans_jax.train import (Checkpointer, MeshConfig, OptimizerConfig, make_mesh,
                                   make_optimizer)
  from knittrans_jax.train.state import train_state_shapes

  operative = os.path.join(workdir, "operative_config.gin")
  if not os.path.exists(operative):
    raise FileNotFoundError(f"{operative} not found: is {workdir} a training run's work dir?")
  gin.add_config_file_search_path(str(gin_cli.REPO_ROOT))
  gin.parse_config_file(operative, skip_unknown=True)
  cfg = JobConfig()
  if cfg.suite == "vision":
    raise ValueError(f"{workdir} trained the tiny VLM ('vision' suite); only decoders export")
  decoder = DecoderConfig()
  model_cfg = suites.decoder_config(suites.build(cfg, decoder), cfg.checkpoint, decoder)
  mesh_cfg = MeshConfig()
  mesh = make_mesh(mesh_cfg)
  # The job's optimizer (its state is part of the checkpoint), total_steps as it derived them.
  tx = make_optimizer(OptimizerConfig().for_steps(cfg.train_batches * cfg.spec.num_mini_batches))
  graphdef, target, _ = train_state_shapes(lambda r: make_model(model_cfg, None, r), tx, mesh,
                                          mesh_cfg.rules)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  step = ckpt.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"{workdir}/checkpoints holds no checkpoint")
  restored = ckpt.restore(target, step)
  ckpt.close()
  state, _ = restored
  model = nnx.merge(graphdef, state.params)
  # The source checkpoint's special-token ids, so EOS is right without generation_config.
  extra = {}
  if cfg.checkpoint:
    source = hf.read_config(cfg.checkpoint)
    extra = {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
             if source.get(k) is not None}
  files = hf.save(model, model_cfg, out, dtype=dtype, extra_config=extra)
  tok_dir = (MathTaskConfig().tokenizer if cfg.suite == "math" else None) or cfg.checkpoint
  copied = []
  for fn in TOKENIZER_FILES:
    if tok_dir and os.path.exists(os.path.join(tok_dir, fn)):
      shutil.copy(os.path.join(tok_dir, fn), os.path.join(out, fn))
      copied.append(fn)
  if "generation_config.json" not in copied and "eos_token_id" in extra:
    with open(os.path.join(out, "generation_config.json"), "w") as f:
      json.dump({k: extra[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                 if k in extra}, f, indent=2)
    copied.append("generation_config.json")
  return {"step": step, "out": out, "files": [os.path.basename(f) for f in files],
          "tokenizer_files": copied, "family": hf.hf_family(model_cfg)}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="the training run's work dir")
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  parser.add_argument("--dtype", default=None, help="tensor dtype (default: the parameters')")
  cli.add_check_flag(parser)
  args = parser.parse_args()
  if cli.check_only(args):
    return
  info = export(args.workdir, args.out, args.step, args.dtype)
  print(f"exported step {info['step']} of {args.workdir} as {info['family']} to {info['out']}: "
        f"{', '.join(info['files'] + info['tokenizer_files'])}")


if __name__ == "__main__":
  main()
