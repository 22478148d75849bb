"""The rollout engines side by side: the same weights and requests on each.

  python scripts/bench_rollout.py --json runs/bench_rollout.json

Workload: `--groups` groups of the config's sources (default configs/text_grpo_tails.gin,
the long-tailed `chain_long` beside short sources, with DecoderConfig.heads = 2 so the
head dim is 32, as vLLM's CPU kernels need), n responses each, one decoder (random and
seeded, or `--checkpoint`: a trained policy, whose responses stop where the tasks
end, so the sources' lengths differ and tails show), all requests handed to the engine at t = 0, as a rollout worker with a full
queue does. Engines (each warmed up on the same requests first, so no compilation or
engine set-up is timed):
  jax         the JAX sampler at the config's groups_per_call (one group per call in the
              tails config: each finishes on its own longest response);
  jax_static  the JAX sampler, every group in one call (its best throughput, one batch
              barrier: every group finishes with the longest response);
  vllm        vLLM in this process (continuous batching).
Per engine: tokens/s (response tokens over the wall time), the time from t = 0 to the
first finished group, the distribution of group completion times (p50/p90/p99).
For vLLM also: seconds per weight update (`--updates` updates of perturbed weights,
collective_rpc + reload + prefix-cache reset) beside the time to copy the same bytes
in numpy, and the largest |behaviour log-prob - trainer log-prob| over every response
(the trainer's forward on the same weights, lag 0).
"""
from __future__ import annotations

import argparse
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
from knittrans_jax.job.config import JobConfig
from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rl import token_logprobs
from knittrans_jax.rollout.engine import EngineSpec
from knittrans_jax.rollout.engines import make_engine
from knittrans_jax.rollout.groups import Suite, suite_sources
from knittrans_jax.rollout.sampler import SamplerConfig


def percentiles(xs) -> dict:
  return {f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)}


def requests(seed: int, groups: int, n: int, sources, start: int = 0):
  rng = np.random.default_rng(seed)
  suite = Suite("text")
  return [suite.request(suite.task(seed, g, str(rng.choice(sources))), seed, g, n)
          for g in range(start, start + groups)]


def timed_run(engine, reqs) -> dict:
  """All of `reqs` at t = 0; each group's completion time since then."""
  t0 = time.perf_counter()
  engine.add(reqs)
  done = {}
  while engine.busy:
    for g in engine.step():
      done[g.request.group_id] = (time.perf_counter() - t0, g)
  wall = time.perf_counter() - t0
  times = [t for t, _ in done.values()]
  tokens = sum(r.tokens.size for _, g in done.values() for r in g.responses)
  return {"tokens_per_s": tokens / wall, "wall_s": wall, "response_tokens": tokens,
          "first_group_s": min(times), "group_time_s": percentiles(times),
          "groups": len(done)}, [g for _, g in done.values()]


def trainer_logprob_diff(model, groups, temperature: float, length: int) -> float:
  """max |behaviour - trainer| log-prob over every response (top_p = 1: the loss's
  own token_logprobs on the trainer's forward)."""
  rows = [(g.request.prompt, r) for g in groups for r in g.responses]
  forward = jax.jit(lambda t: token_logprobs(model(t, jnp.ones(t.shape, bool)) / temperature, t)[0])
  worst = 0.0
  for k in range(0, len(rows), 64):
    chunk = rows[k:k + 64]
    seq = np.zeros((64, length), np.int32)
    for i, (p, r) in enumerate(chunk):
      seq[i, :p.size + r.tokens.size] = np.concatenate([p, r.tokens])
    lp = np.asarray(forward(jnp.asarray(seq)))
    for i, (p, r) in enumerate(chunk):
      worst = max(worst, float(np.abs(lp[i, p.size:p.size + r.tokens.size] - r.logprobs).max()))
  return worst


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  cli.add_flags(parser)
  parser.add_argument("--json", default="runs/bench_rollout.json")
  parser.add_argument("--groups", type=int, default=64)
  parser.add_argument("--updates", type=int, default=5)
  parser.add_argument("--engines", default="jax,jax_static,vllm")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--checkpoint", default=None,
                      help="a Hugging Face decoder directory (e.g. scripts/export_hf.py of a "
                      "trained run); default: random weights, whose responses all run to "
                      "max_new_tokens, so no engine shows a tail")
  args = parser.parse_args()
  args.gin_file = args.gin_file or ["configs/text_grpo_tails.gin"]
  args.gin_bindings = ["DecoderConfig.heads = 2", *args.gin_bindings]
  cli.parse(args)
  job, model_cfg, sampler = JobConfig(), DecoderConfig(), SamplerConfig()
  if sampler.top_p != 1.0:
    raise SystemExit("bench_rollout compares log-probs at top_p = 1 (the loss's own function)")
  if cli.check_only(args):
    gin.clear_config()
    return
  n, sources = job.spec.group_size, tuple(job.spec.source_quota or suite_sources("text"))
  if args.checkpoint:
    from knittrans_jax.models import hf
    model, model_cfg = hf.load(args.checkpoint)
  else:
    with nnx.use_eager_sharding(False):
      model = DecoderLM(model_cfg, nnx.Rngs(args.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  host = jax.device_get(params)
  reqs = requests(args.seed, args.groups, n, sources)
  length = Suite("text").prompt_len + sampler.max_new_tokens
  out = {"config": {"gin_file": args.gin_file, "gin_bindings": args.gin_bindings,
                    "groups": args.groups, "n": n, "sources": sources,
                    "max_new_tokens": sampler.max_new_tokens, "head_dim": model_cfg.dim_per_head,
                    "groups_per_call": job.groups_per_call, "cpus": os.cpu_count(),
                    "checkpoint": args.checkpoint},
         "engines": {}}
  names = args.engines.split(",")
  for name in tqdm(names, desc="engines", unit="engine"):
    per_call = {"jax": job.groups_per_call, "jax_static": args.groups}.get(name, 1)
    with tempfile.TemporaryDirectory() as tmp:
      spec = EngineSpec("vllm" if name == "vllm" else "jax", model_cfg, sampler, args.seed,
                        groups_per_call=per_call, workdir=tmp, prompts=Suite("text").prompt_spec)
      t0 = time.perf_counter()
      engine = make_engine(spec, graphdef, host, 0)
      startup = time.perf_counter() - t0
      timed_run(engine, requests(args.seed + 1, args.groups, n, sources, start=10**6))  # warm up
      res, groups = timed_run(engine, reqs)
      res["startup_s"] = startup
      if name == "vllm":
        res["logprob_max_abs_diff"] = trainer_logprob_diff(model, groups, sampler.temperature, length)
        from knittrans_jax.rollout.vllm_engine import hf_tensors
        rng = np.random.default_rng(args.seed)
        nbytes = sum(len(b) for _, b, _, _ in hf_tensors(host))
        upd, copy = [], []
        for v in range(1, args.updates + 1):
          new = jax.tree.map(lambda x: x + np.float32(1e-3) * rng.standard_normal(x.shape, np.float32),
                             host)
          t = time.perf_counter()
          engine.update_weights(v, new)
          upd.append(time.perf_counter() - t)
          leaves = jax.tree.leaves(new)
          t = time.perf_counter()
          _ = [np.array(x, copy=True) for x in leaves]
          copy.append(time.perf_counter() - t)
        res.update(weight_update_s=float(np.median(upd)), weight_bytes=nbytes,
                   weight_copy_s=float(np.median(copy)),
                   weight_update_vs_copy=float(np.median(upd) / max(np.median(copy), 1e-12)))
      engine.close()
    out["engines"][name] = res
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=2)
  print(f"\n{'engine':<11} {'tokens/s':>9} {'first s':>8} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} "
        f"{'wall s':>7}")
  for name, r in out["engines"].items():
    g = r["group_time_s"]
    print(f"{name:<11} {r['tokens_per_s']:9.0f} {r['first_group_s']:8.3f} {g['p50']:7.3f} "
          f"{g['p90']:7.3f} {g['p99']:7.3f} {r['wall_s']:7.3f}")
  if "vllm" in out["engines"]:
    r = out["engines"]["vllm"]
    print(f"vllm weight update {r['weight_update_s'] * 1e3:.1f} ms for {r['weight_bytes'] / 1e6:.2f} MB "
          f"(numpy copy {r['weight_copy_s'] * 1e3:.2f} ms); logprob_max_abs_diff "
          f"{r['logprob_max_abs_diff']:.2e}")
  print(f"wrote {args.json}")
  gin.clear_config()


if __name__ == "__main__":
  main()
