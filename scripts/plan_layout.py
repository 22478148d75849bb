"""Per-device memory of the train step for a model under every mesh layout, compiled
ahead of time on fake CPU devices: no weights loaded, no accelerator needed.

  python scripts/plan_layout.py --model configs/models/qwen2_5_7b.gin --devices 8
  python scripts/plan_layout.py --model configs/models/qwen2_5_0_5b.gin --devices 8 \
      --rows 16 --seq_len 2048 --gin_bindings "DecoderConfig.remat = 'full'" --json plan.json

For each mesh file (default: every configs/mesh/*.gin) the micro step (forward and
backward of `rows` x `seq_len` tokens, accumulating gradients) and the optimizer
update are lowered on abstract inputs and compiled (`jax.jit(...).lower(...).compile()`).
Parameters, optimizer state and the gradient accumulator are counted from their
shardings (exact: the bytes each device holds); temporaries come from XLA's compiled
memory analysis; `saved_act` is what autodiff keeps for the backward pass (where
DecoderConfig.remat shows), divided over the batch shards. `peak` adds the resident
state and the batch to the larger of the two steps' temporaries; with LossConfig.kl_coef
> 0 the resident state includes the reference policy's parameters (`reference_bytes`)
and the micro step its forward pass. `logits_materialised`:
whether the step's program (traced, not compiled) holds a [rows, seq_len, vocab]
array; `largest_vocab_activation` is the biggest vocabulary-sized one it does hold
(train/program_arrays.py). The step computes log-probs from the hidden states in
chunks of LossConfig.logprob_chunk tokens; `--full_logits` plans the step as it was
before (the whole [rows, seq_len, vocab] logits), for comparison. docs/models.md says
how far CPU figures carry to GPU and TPU.

JSON: `plans` (a list) and `layouts` {mesh name: the same plan}, each with
`peak_bytes`, `compile_s`, `logits_materialised`; top-level `logits_materialised` is
true if any layout's is.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from knittrans_jax import cli  # noqa: E402  (no JAX: XLA_FLAGS are set in main, before it)


def _fmt(x: float, unit: int) -> str:
  return f"{x / unit:9.3f}"


def saved_activation_bytes(fns, params, batch) -> int | None:
  """Bytes of the activations the forward pass keeps for the backward pass (the
  residuals of jax's autodiff, parameters excluded) for the whole micro-batch. This
  is where DecoderConfig.remat shows: XLA's CPU buffer assignment does not schedule
  for memory, so the compiled temporaries barely move with it (docs/models.md)."""
  import contextlib
  import io
  import re

  import jax.ad_checkpoint
  from flax import nnx

  def loss(p, b):
    return fns.objective_sum(fns.forward(nnx.merge(fns.graphdef, p), b), b)[0]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):  # jax's public view: one residual a line
    jax.ad_checkpoint.print_saved_residuals(loss, params, batch)
  total = 0
  for line in out.getvalue().splitlines():  # e.g. "bf16[16,2048,3584] output of dot_general"
    m = re.match(r"([a-z]+)(\d*)\[([\d,]*)\]\s+(.*)", line.strip())
    if m is None:
      return None  # a format this code does not know: no figure rather than a wrong one
    kind, bits, dims, why = m.groups()
    if "argument" in why:
      continue
    size = math.prod(int(d) for d in dims.split(",") if d)
    total += size * (max(int(bits), 8) // 8 if bits else 1)  # bool: a byte
  return total


def _rows_per_shard(sharding, rows: int) -> int:
  return sharding.shard_shape((rows, 1))[0]


def full_logits_forward(model, batch):
  """The train step's forward before chunked log-probs: the whole logits."""
  return model(batch["tokens"], batch["attention_mask"])


def plan(model_gin: str, mesh_gin: str, rows: int, seq_len: int, bindings: list[str],
         full_logits: bool = False, packed: bool = False) -> dict:
  import gin
  import jax
  import jax.numpy as jnp

  from knittrans_jax import gin_cli
  from knittrans_jax.models.decoder import DecoderConfig
  from knittrans_jax.models.vlm import make_model
  from knittrans_jax.rl import LossConfig
  from knittrans_jax.train import MeshConfig, OptimizerConfig, StepFunctions, make_mesh, make_optimizer
  from knittrans_jax.train.batch import batch_shardings
  from knittrans_jax.mesh import replicated
  from knittrans_jax.train.program_arrays import largest_vocab_activation
  from knittrans_jax.train.state import train_state_shapes
  from knittrans_jax.train.step import text_forward

  gin.clear_config()
  gin.add_config_file_search_path(str(gin_cli.REPO_ROOT))
  gin.parse_config_files_and_bindings([model_gin, mesh_gin], bindings, finalize_config=False)
  model_cfg, mesh_cfg = DecoderConfig(), MeshConfig()
  out = {"mesh_file": os.path.basename(mesh_gin), "mesh": mesh_cfg.name}
  try:
    mesh = make_mesh(mesh_cfg)
  except ValueError as e:
    return {**out, "error": str(e)}
  out["mesh_shape"] = dict(mesh.shape)
  tx = make_optimizer(OptimizerConfig())
  try:
    graphdef, state, sh = train_state_shapes(lambda r: make_model(model_cfg, None, r), tx, mesh,
                                             mesh_cfg.rules)
  except ValueError as e:  # e.g. a dimension that a mesh axis does not divide
    return {**out, "error": str(e)}
  forward = full_logits_forward if full_logits else text_forward
  fns = StepFunctions(graphdef, sh, tx, LossConfig(), mesh, mesh_cfg.rules, forward=forward)

  def per_device(tree, shardings=None) -> int:
    leaves = jax.tree.leaves(tree)
    shs = jax.tree.leaves(shardings) if shardings is not None else [x.sharding for x in leaves]
    return sum(math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x, s in zip(leaves, shs))

  params_b = per_device(state.params)
  opt_b = per_device(state.opt_state)
  acc = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding),
                     state.params)
  grads_b = per_device(acc)
  batch = {"tokens": (jnp.int32, (rows, seq_len)), "attention_mask": (jnp.bool_, (rows, seq_len)),
           "loss_mask": (jnp.float32, (rows, seq_len)),
           "behaviour_logp": (jnp.float32, (rows, seq_len)), "advantages": (jnp.float32, (rows,))}
  if packed:  # job/batching.build_packed_batch: segments, their positions, per-token advantages
    batch.update(segment_ids=(jnp.int32, (rows, seq_len)), positions=(jnp.int32, (rows, seq_len)),
                 advantages=(jnp.float32, (rows, seq_len)))
  batch = {k: jax.ShapeDtypeStruct(s, d) for k, (d, s) in batch.items()}
  bsh = batch_shardings(mesh, mesh_cfg.rules, batch)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bsh[k]) for k, v in batch.items()}
  repl = replicated(mesh)
  # With a KL term the step also holds the reference policy's parameters (sharded like
  # the policy's) and runs its forward pass on every micro-batch.
  ref = state.params if fns.needs_reference else None
  sums = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=repl),
                      jax.eval_shape(lambda st, b, r: fns._micro(st.params, b, jnp.float32(1),
                                                                 None, r)[1], state, batch, ref))
  n = jax.ShapeDtypeStruct((), jnp.float32, sharding=repl)
  vocab_shape = largest_vocab_activation(
      lambda st, b, r: fns._micro(st.params, b, jnp.float32(1), None, r), state, batch, ref,
      vocab=model_cfg.vocab_size)
  saved = saved_activation_bytes(fns, state.params, batch)
  if saved is not None:  # activations are split over the batch shards (at least)
    saved //= max(1, rows // max(1, _rows_per_shard(bsh["tokens"], rows)))
  t0 = time.perf_counter()
  try:
    micro = fns.micro_jit(batch, reference=ref is not None).lower(
        state, acc, sums, batch, n, *([ref] if ref is not None else [])).compile()
    apply = fns.apply_step.lower(state, acc).compile()
  except Exception as e:  # noqa: BLE001  (XLA reports layout problems as runtime errors)
    return {**out, "error": f"{type(e).__name__}: {str(e)[:300]}"}
  compile_s = time.perf_counter() - t0
  m, a = micro.memory_analysis(), apply.memory_analysis()
  ref_b = params_b if ref is not None else 0
  resident = params_b + opt_b + grads_b + ref_b
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
  return {**out, "params": n_params, "params_bytes": params_b, "opt_state_bytes": opt_b,
          "grad_acc_bytes": grads_b, "reference_bytes": ref_b,
          "micro_temp_bytes": int(m.temp_size_in_bytes),
          "apply_temp_bytes": int(a.temp_size_in_bytes),
          "batch_bytes": per_device(batch), "saved_activation_bytes": saved,
          "peak_bytes": resident + per_device(batch) + max(int(m.temp_size_in_bytes),
                                                           int(a.temp_size_in_bytes)),
          "compile_s": round(compile_s, 2), "largest_vocab_activation": list(vocab_shape),
          "logits_materialised": math.prod(vocab_shape) >= rows * (seq_len - 1) * model_cfg.vocab_size}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", required=True, help="a model gin file (configs/models/*.gin)")
  parser.add_argument("--mesh", action="append", default=[],
                      help="mesh gin file (repeatable; default: every configs/mesh/*.gin)")
  parser.add_argument("--devices", type=int, default=8, help="fake CPU devices to plan for")
  parser.add_argument("--rows", type=int, default=None,
                      help="rows per micro-batch (default: --devices)")
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="e.g. \"DecoderConfig.remat = 'full'\" (repeatable)")
  parser.add_argument("--json", default=None, help="write the plans here")
  parser.add_argument("--full_logits", action="store_true",
                      help="plan the step with the whole logits, as before chunked log-probs")
  parser.add_argument("--packed", action="store_true",
                      help="plan packed rows (JobConfig.packing: segment ids, positions)")
  cli.add_check_flag(parser)
  args = parser.parse_args()
  # Before JAX starts: N host devices stand in for the accelerators.
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  from knittrans_jax import gin_cli
  meshes = args.mesh or sorted(glob.glob(str(gin_cli.REPO_ROOT / "configs" / "mesh" / "*.gin")))
  rows = args.rows or args.devices
  bindings = args.gin_bindings
  if args.check_args:  # each layout's configs (DecoderConfig, MeshConfig), nothing compiled
    import gin
    for mesh_gin in meshes:
      cli.parse(argparse.Namespace(gin_file=[args.model, mesh_gin], gin_bindings=bindings,
                                   check_args=True))
      gin.clear_config()
    cli.check_only(args)
    return
  plans = []
  from tqdm import tqdm
  for mesh_gin in tqdm(meshes, desc="compiling", unit="layout", disable=None):
    plans.append(plan(gin_cli._resolve(args.model), gin_cli._resolve(mesh_gin), rows,
                      args.seq_len, bindings, args.full_logits, args.packed))
  print(f"\n{args.model}: {args.devices} devices, micro-batch {rows} x {args.seq_len} tokens"
        f"{' packed' if args.packed else ''}"
        f"{'; ' + '; '.join(args.gin_bindings) if args.gin_bindings else ''}")
  ok = [p for p in plans if "error" not in p]
  big = max((p["peak_bytes"] for p in ok), default=0) >= 2**30
  unit, name = (2**30, "GiB") if big else (2**20, "MiB")
  cols = ("params_bytes", "opt_state_bytes", "grad_acc_bytes", "reference_bytes",
          "saved_activation_bytes", "micro_temp_bytes", "apply_temp_bytes", "peak_bytes")
  print(f"{name} per device    params  opt_state  grad_acc  reference  saved_act  micro_tmp  "
        "apply_tmp       peak  compile_s  logits")
  for p in plans:
    if "error" in p:
      print(f"{p['mesh']:<14} does not fit: {p['error']}")
      continue
    print(f"{p['mesh']:<14}" + "".join(_fmt(p[c] or 0, unit) + " " for c in cols) +
          f"{p['compile_s']:9.1f}  {'[B,T,V]' if p['logits_materialised'] else 'chunked'}")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"model": args.model, "devices": args.devices, "rows": rows,
                 "seq_len": args.seq_len, "bindings": args.gin_bindings,
                 "full_logits": args.full_logits, "packed": args.packed, "plans": plans,
                 "layouts": {p["mesh"]: p for p in plans},
                 "logits_materialised": any(p.get("logits_materialised") for p in ok)}, f,
                indent=2)


if __name__ == "__main__":
  main()
