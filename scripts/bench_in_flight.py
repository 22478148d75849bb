"""vLLM's in-flight weight-update modes side by side (VllmOptions.in_flight, issue 47).

  python scripts/bench_in_flight.py --json runs/bench_in_flight.json

'reprefill' (the default): at an update every running request is re-prefilled with the
new weights, so each token after it is exactly the new weights' sample. 'keep'
(PipelineRL's): running requests keep the KV the old weights computed and sample on
with the new weights: no re-prefill, but each later token's log-prob is the new
weights' over the old weights' KV, which no trainer forward reproduces.

Method: one vLLM engine in this process on a random decoder (the workload's,
configs/text_long_tails.gin by default, DecoderConfig.heads = 2 for vLLM's head dim of
32, seeded), `--groups` groups of n random-token prompts, every response run to
max_new_tokens (no stop token: the same work in both modes). When every response has
`--update_at` tokens the weights are replaced by a perturbed copy (each floating leaf
plus `--update_scale` times its own standard deviation times N(0, 1): an optimizer
step's size relative to the weights), then the requests run to the end. Per mode:
  update_s     the engine's update_weights (the reload; for 'reprefill' also the
               prefix-cache reset)
  finish_s     from the update to the last response (the re-prefill's cost is here)
  tokens_per_s response tokens over the whole run
  gap_after    |engine - trainer| log-prob on every token sampled after the update,
               the trainer's forward on the whole sequence with the new weights (what
               the importance ratio at the new version sees): mean and max
  gap_before   the same before the update, against the old weights (both modes: the
               numerical floor)
`floor`: the gap of responses generated wholly on the new weights. The modes alternate
`--repeats` times on the same engine and prompts; the prefix cache is emptied before
each run. The trainer's log-probs are rl/losses.py's token_logprobs at top_p = 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from knittrans_jax import cli
from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rl import token_logprobs
from knittrans_jax.rollout.engine import EngineSpec, GroupRequest, response_seeds
from knittrans_jax.rollout.engines import make_engine
from knittrans_jax.rollout.sampler import SamplerConfig

MODES = ("reprefill", "keep")


def perturbed(params, scale: float, seed: int):
  """Each floating leaf plus `scale` x its standard deviation x N(0, 1)."""
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  out = []
  for x in leaves:
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating):
      x = (x + scale * float(x.std()) * rng.standard_normal(x.shape)).astype(x.dtype)
    out.append(x)
  return jax.tree.unflatten(treedef, out)


def trainer_logprobs_fn(graphdef, length: int, temperature: float):
  """(params, prompt, tokens) -> the trainer's log-prob of each response token."""
  @jax.jit
  def forward(params, seq):
    model = nnx.merge(graphdef, params)
    return token_logprobs(model(seq, jnp.ones(seq.shape, bool)) / temperature, seq)[0]

  def logprobs(params, prompt, tokens):
    seq = np.zeros((1, length), np.int32)
    seq[0, :prompt.size + tokens.size] = np.concatenate([prompt, tokens])
    return np.asarray(forward(params, jnp.asarray(seq)))[0, prompt.size:prompt.size + tokens.size]
  return logprobs


def _gap(diffs: list[np.ndarray]) -> dict:
  d = np.concatenate(diffs) if diffs else np.zeros(0)
  return {"tokens": int(d.size), "mean": float(d.mean()) if d.size else None,
          "max": float(d.max()) if d.size else None}


def run_mode(engine, mode: str, old, new, reqs: list[GroupRequest], update_at: int,
             version: int, logprobs) -> dict:
  """One run (module doc): `reqs` on `old`, the update to `new` (as `version`) once
  every response has `update_at` tokens, then to the end. The engine is left on `new`."""
  engine.options = dataclasses.replace(engine.options, in_flight=mode)
  engine.engine.reset_prefix_cache()
  total = sum(r.n for r in reqs)
  done, t0 = [], time.perf_counter()
  engine.add(reqs)
  while engine.busy:
    finished = sum(len(g.responses) for g in done)
    if finished + sum(len(p[1]) >= update_at for p in engine.partial.values()) >= total:
      break
    done += engine.step()
  before_update = {f"{g.request.group_id}:{i}" for g in done for i in range(g.request.n)}
  at = {rid: len(p[1]) for rid, p in engine.partial.items()}
  t1 = time.perf_counter()
  engine.update_weights(version, new)
  t2 = time.perf_counter()
  while engine.busy:
    done += engine.step()
  t3 = time.perf_counter()
  after, before, tokens = [], [], 0
  for g in done:
    for i, r in enumerate(g.responses):
      rid = f"{g.request.group_id}:{i}"
      k = r.tokens.size if rid in before_update else at.get(rid, 0)
      tokens += r.tokens.size
      if k:
        before.append(np.abs(r.logprobs[:k] - logprobs(old, g.request.prompt, r.tokens)[:k]))
      if k < r.tokens.size:
        after.append(np.abs(r.logprobs[k:] - logprobs(new, g.request.prompt, r.tokens)[k:]))
  return {"update_s": t2 - t1, "finish_s": t3 - t2, "wall_s": t3 - t0,
          "tokens_per_s": tokens / (t3 - t0), "response_tokens": tokens,
          "gap_after": _gap(after), "gap_before": _gap(before)}


def floor(engine, new, reqs, logprobs) -> dict:
  """The gap of responses generated wholly on `new` (the engine's current weights)."""
  diffs = [np.abs(r.logprobs - logprobs(new, g.request.prompt, r.tokens))
           for g in engine.generate(reqs) for r in g.responses]
  return _gap(diffs)


def compare(engine, params, new, reqs, update_at: int, repeats: int, logprobs,
            modes=MODES) -> dict:
  """The modes alternated `repeats` times (module doc); the engine starts and ends on
  `params`. Versions count up from the engine's own."""
  version = engine.version
  runs = {m: [] for m in modes}
  for _ in range(repeats):
    for m in modes:
      runs[m].append(run_mode(engine, m, params, new, reqs, update_at, version + 1, logprobs))
      engine.update_weights(version + 2, params)  # nothing in flight: back to the old weights
      version += 2
  engine.update_weights(version + 1, new)
  base = floor(engine, new, reqs, logprobs)
  engine.update_weights(version + 2, params)
  out = {"floor": base, "modes": {}}
  for m, rs in runs.items():
    out["modes"][m] = {
        "runs": rs,
        **{k: float(np.median([r[k] for r in rs])) for k in ("update_s", "finish_s",
                                                             "tokens_per_s")},
        "gap_after_mean": float(np.mean([r["gap_after"]["mean"] for r in rs])),
        "gap_after_max": float(max(r["gap_after"]["max"] for r in rs)),
        "gap_before_max": float(max(r["gap_before"]["max"] for r in rs))}
  if set(modes) == set(MODES):
    k, r = out["modes"]["keep"], out["modes"]["reprefill"]
    out["keep_vs_reprefill"] = {"tokens_per_s": k["tokens_per_s"] / r["tokens_per_s"],
                                "finish_s": k["finish_s"] / r["finish_s"],
                                "gap_after_mean": k["gap_after_mean"] / r["gap_after_mean"]}
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  cli.add_flags(parser)
  parser.add_argument("--json", default="runs/bench_in_flight.json")
  parser.add_argument("--groups", type=int, default=8)
  parser.add_argument("--n", type=int, default=4, help="responses a prompt")
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--update_at", type=int, default=None,
                      help="tokens every response has when the weights change (default: "
                      "half of SamplerConfig.max_new_tokens)")
  parser.add_argument("--update_scale", default="0.001,0.01",
                      help="the update's size per leaf in units of the leaf's standard "
                      "deviation; a comma list: one comparison each")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  args.gin_file = args.gin_file or ["configs/text_long_tails.gin"]
  args.gin_bindings = ["DecoderConfig.heads = 2", *args.gin_bindings]
  cli.parse(args)
  model_cfg, sampler = DecoderConfig(), SamplerConfig()
  sampler = dataclasses.replace(sampler, stop_tokens=())  # every response runs to the length
  scales = [float(s) for s in args.update_scale.split(",")]
  update_at = args.update_at if args.update_at is not None else sampler.max_new_tokens // 2
  if not 0 < update_at < sampler.max_new_tokens:
    raise SystemExit(f"--update_at {update_at}: between 1 and SamplerConfig.max_new_tokens - 1 "
                     f"= {sampler.max_new_tokens - 1}")
  if sampler.top_p != 1.0:
    raise SystemExit(f"SamplerConfig.top_p = {sampler.top_p}: the gap is measured at top_p = 1 "
                     "(the loss's own log-probs)")
  if cli.check_only(args):
    gin.clear_config()
    return
  from knittrans_jax.rollout.vllm_engine import VllmOptions
  with nnx.use_eager_sharding(False):
    model = DecoderLM(model_cfg, nnx.Rngs(args.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  params = jax.device_get(params)
  length = args.prompt_len + sampler.max_new_tokens
  rng = np.random.default_rng(args.seed)
  reqs = [GroupRequest(g, "random", rng.integers(2, model_cfg.vocab_size, args.prompt_len)
                       .astype(np.int32), args.n, response_seeds(args.seed, g, args.n))
          for g in range(args.groups)]
  logprobs = trainer_logprobs_fn(graphdef, length, sampler.temperature)
  out = {"config": {"gin_file": args.gin_file, "gin_bindings": args.gin_bindings,
                    "groups": args.groups, "n": args.n, "prompt_len": args.prompt_len,
                    "max_new_tokens": sampler.max_new_tokens, "update_at": update_at,
                    "repeats": args.repeats, "seed": args.seed, "cpus": os.cpu_count(),
                    "parameters": int(sum(np.size(x) for x in jax.tree.leaves(params)))},
         "scales": {}}
  with tempfile.TemporaryDirectory() as tmp:
    spec = EngineSpec("vllm", model_cfg, sampler, args.seed, workdir=tmp,
                      options=VllmOptions(max_model_len=length))
    engine = make_engine(spec, graphdef, params, 0)
    try:
      engine.generate(reqs[:1])  # warm-up
      for s in tqdm(scales, desc="update scales", unit="scale"):
        new = perturbed(params, s, args.seed + 1)
        out["scales"][str(s)] = compare(engine, params, new, reqs, update_at, args.repeats,
                                        logprobs)
    finally:
      engine.close()
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"{'scale':>7} {'mode':>10} {'tok/s':>8} {'update s':>9} {'finish s':>9} "
        f"{'gap after mean/max':>20} {'before max':>11}")
  for s, res in out["scales"].items():
    for m, r in res["modes"].items():
      print(f"{s:>7} {m:>10} {r['tokens_per_s']:8.0f} {r['update_s']:9.3f} {r['finish_s']:9.2f} "
            f"{r['gap_after_mean']:10.2e}/{r['gap_after_max']:8.2e} {r['gap_before_max']:11.2e}")
    print(f"{s:>7} {'floor':>10} {'':>8} {'':>9} {'':>9} "
          f"{res['floor']['mean']:10.2e}/{res['floor']['max']:8.2e}")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
