"""The rollout engines side by side: the same weights and requests on each.

  python scripts/bench_rollout.py --json runs/bench_rollout.json
  python scripts/bench_rollout.py --workload agentic --json runs/bench_rollout_agentic.json
  python scripts/bench_rollout.py --workload long_tails --json runs/bench_rollout_long.json
  python scripts/bench_rollout.py --model configs/models/qwen2_5_0_5b.gin --engines jax \
      --weights_only --updates 6 --json runs/bench_rollout_weights_0_5b.json

Workloads (`--workload`): 'tails' (the default, below), 'long_tails'
(configs/text_long_tails.gin: answers of 16 to 512 tokens; the same method as
'tails') and 'agentic' (configs/agentic_tails.gin: multi-turn tool episodes on each
engine's agent loop, rollout/agent_loop.py). The agentic run keeps `--in_flight`
groups in the loop (a new one starts when one ends, as a worker with a full queue
does) and times each group from its start to its last episode's end; it reports
tokens/s (generated turn tokens over the wall time), the group times (p50/p90/p99,
`p99_over_p50`), `busy_fraction` (the engine's share of the wall time in which it
had turns to generate: whether a turn ever waits behind an environment or the loop),
`engine_utilization` (its share of all the time episodes were in flight: low when
every episode waits on its tool, too few in flight for the tools' latency) and the
turns per episode. Each run is preceded by the same run on other prompts (the JAX
engine compiles its padded shapes there).

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
For vLLM also the largest |behaviour log-prob - trainer log-prob| over every response
(the trainer's forward on the same weights, lag 0).
For both engines: seconds per weight update from the trainer's arrays to the engine's,
through the job's own WeightPublisher / WeightSubscriber (rollout/weights.py), on the
run's transport (WeightSyncConfig: shared memory by default) and on the old one ('files':
.npz parts in a work dir on /dev/shm, `old_path`), each beside a numpy copy of the same
bytes timed in the same run (`copy_s`, `weight_update_vs_copy`; `copy_warm_s`, the
same copy into memory touched before, `weight_update_vs_warm_copy`). One update is a
publish (write_part + commit), one worker's poll and the engine's update_weights. For
vLLM the engine's update is its workers' reload from views of the published segment
('shm'; from a Hugging Face segment written for the arrays with 'files') and the
prefix-cache reset; of the update, vLLM's own `reload_weights` (its copy into its
parameters and its post-load processing, e.g. re-packing for its CPU kernels) is
`engine_processing_s`, the rest `ours_s` (`ours_vs_copy`, `ours_vs_warm_copy`).
Figures are medians over the updates; the trainer's first two publishes allocate new
segments, later ones are written into spares (WeightSyncConfig.spare_segments;
`segments_reused` counts them), so give `--updates` of 5 or more for the steady state
(every update's times are in `runs`).

`--model`: a model gin file (configs/models/) read after the workload's, with the
model's own head count (no vLLM head-dim override). `--weights_only`: no generation,
only the weight updates (a 0.5B decoder's generation takes long on a few CPU cores).
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
from knittrans_jax.bench.timing import percentiles
from knittrans_jax.bench.weight_updates import weight_updates
from knittrans_jax.job.config import JobConfig
from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rl import token_logprobs
from knittrans_jax.rollout.engine import EngineSpec
from knittrans_jax.rollout.engines import make_engine
from knittrans_jax.rollout.agent_loop import AgentConfig, FailedGroup
from knittrans_jax.rollout.agentic_tasks import AgenticTaskConfig
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.rollout.weights import WeightSyncConfig
from knittrans_jax.suites import AgenticSuite, TaskSuite, TextSuite

WORKLOADS = {"tails": "configs/text_grpo_tails.gin", "long_tails": "configs/text_long_tails.gin",
             "agentic": "configs/agentic_tails.gin"}


def requests(seed: int, groups: int, n: int, sources, start: int = 0):
  rng = np.random.default_rng(seed)
  suite = TextSuite()
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
  pct = percentiles(times)
  return {"tokens_per_s": tokens / wall, "wall_s": wall, "response_tokens": tokens,
          "first_group_s": min(times), "group_time_s": pct, "p99_over_p50": pct["p99"] / pct["p50"],
          "groups": len(done)}, [g for _, g in done.values()]


def _vllm_options(name: str, max_len: int):
  """vLLM's options with a context that holds the workload's longest sequence."""
  if name != "vllm":
    return None
  from knittrans_jax.rollout.vllm_engine import VllmOptions
  return VllmOptions(max_model_len=max_len)


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


def agentic_run(engine, suite: TaskSuite, sampler, seed: int, groups: int, n: int, sources,
                in_flight: int, start: int = 0) -> dict:
  """`groups` agentic groups through an agent loop over `engine`, `in_flight` at once."""
  rng = np.random.default_rng(seed)
  todo = [(g, str(rng.choice(sources))) for g in range(start, start + groups)]
  loop = suite.agent_loop(engine, sampler)
  times, turns, tokens, failed = [], [], 0, 0
  t0 = time.perf_counter()
  with tqdm(total=groups, desc="groups", unit="group", leave=False) as bar:
    while todo or loop.busy:
      while todo and len(loop.groups) < in_flight:
        gid, source = todo.pop(0)
        suite.start(loop, suite.task(seed, gid, source), seed, gid, n)
      for g in loop.step():
        bar.update(1)
        if isinstance(g, FailedGroup):
          failed += 1
          continue
        times.append(g.seconds)
        turns += [len(ep.turns) for ep in g.episodes]
        tokens += sum(t.tokens.size for ep in g.episodes for t in ep.turns)
  wall = time.perf_counter() - t0
  busy, utilization = loop.busy_fraction, loop.utilization
  loop.close()
  pct = percentiles(times)
  return {"tokens_per_s": tokens / wall, "wall_s": wall, "response_tokens": tokens,
          "group_time_s": pct, "p99_over_p50": pct["p99"] / pct["p50"], "busy_fraction": busy,
          "engine_utilization": utilization,
          "turns_per_episode": {"mean": float(np.mean(turns)), **percentiles(turns),
                                "max": int(max(turns))},
          "groups": len(times), "failed_groups": failed}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  cli.add_flags(parser)
  parser.add_argument("--json", default="runs/bench_rollout.json")
  parser.add_argument("--workload", default="tails", choices=tuple(WORKLOADS))
  parser.add_argument("--in_flight", default=None,
                      help="agentic: groups in the agent loop at once, or a comma list (one run "
                      "each, rows named engine@k); default: a worker's share of the job's "
                      "window, JobConfig.window (2G) / JobConfig.workers")
  parser.add_argument("--groups", type=int, default=64)
  parser.add_argument("--updates", type=int, default=5)
  parser.add_argument("--engines", default="jax,jax_static,vllm")
  parser.add_argument("--model", default=None,
                      help="a model gin file (e.g. configs/models/qwen2_5_0_5b.gin), read after "
                      "the workload's")
  parser.add_argument("--weights_only", action="store_true",
                      help="no generation: only the engines' weight updates")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--checkpoint", default=None,
                      help="a Hugging Face decoder directory (e.g. scripts/export_hf.py of a "
                      "trained run); default: random weights, whose responses all run to "
                      "max_new_tokens, so no engine shows a tail")
  args = parser.parse_args()
  args.gin_file = args.gin_file or [WORKLOADS[args.workload]]
  if args.model:  # the model's own shape: no head-dim override for vLLM's kernels
    args.gin_file = [*args.gin_file, args.model]
  else:
    args.gin_bindings = ["DecoderConfig.heads = 2", *args.gin_bindings]
  cli.parse(args)
  job, model_cfg, sampler = JobConfig(), DecoderConfig(), SamplerConfig()
  agentic = job.suite == "agentic"
  window = job.window or 2 * job.spec.groups_per_batch
  in_flight = ([int(k) for k in args.in_flight.split(",")] if args.in_flight
               else [max(1, window // job.workers)])
  if agentic and "jax_static" in args.engines:
    args.engines = ",".join(e for e in args.engines.split(",") if e != "jax_static")
  if sampler.top_p != 1.0:
    raise SystemExit("bench_rollout compares log-probs at top_p = 1 (the loss's own function)")
  if cli.check_only(args):
    gin.clear_config()
    return
  suite = AgenticSuite(AgenticTaskConfig(), AgentConfig()) if agentic else TextSuite()
  n, sources = job.spec.group_size, tuple(job.spec.source_quota or suite.sources)
  if args.checkpoint:
    from knittrans_jax.models import hf
    model, model_cfg = hf.load(args.checkpoint)
  else:
    with nnx.use_eager_sharding(False):
      model = DecoderLM(model_cfg, nnx.Rngs(args.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  host = jax.device_get(params)
  reqs = None if agentic else requests(args.seed, args.groups, n, sources)
  length = TextSuite.prompt_len + sampler.max_new_tokens
  out = {"config": {"workload": args.workload, "gin_file": args.gin_file,
                    "gin_bindings": args.gin_bindings, "in_flight": in_flight if agentic else None,
                    "groups": args.groups, "n": n, "sources": sources,
                    "max_new_tokens": sampler.max_new_tokens, "head_dim": model_cfg.dim_per_head,
                    "groups_per_call": job.groups_per_call, "cpus": os.cpu_count(),
                    "checkpoint": args.checkpoint, "model": args.model,
                    "weights_only": args.weights_only,
                    "parameters": int(sum(np.size(x) for x in jax.tree.leaves(host)))},
         "engines": {}}
  names = args.engines.split(",")
  for name in tqdm(names, desc="engines", unit="engine"):
    per_call = {"jax": job.groups_per_call, "jax_static": args.groups}.get(name, 1)
    with tempfile.TemporaryDirectory() as tmp:
      if agentic:  # turns batch by rows, contexts of any length (rollout/jax_engine.py)
        max_len = suite.loop.max_tokens
        spec = EngineSpec("vllm" if name == "vllm" else "jax", model_cfg, sampler, args.seed,
                          groups_per_call=per_call, workdir=tmp,
                          rows_per_call=per_call * n, options=_vllm_options(name, max_len))
      else:
        spec = EngineSpec("vllm" if name == "vllm" else "jax", model_cfg, sampler, args.seed,
                          groups_per_call=per_call, workdir=tmp, prompts=TextSuite().prompt_spec,
                          options=_vllm_options(name, length))
      t0 = time.perf_counter()
      engine = make_engine(spec, graphdef, host, 0)
      startup = time.perf_counter() - t0
      if agentic:
        precompiled = 0
        if name == "jax":  # every padded shape compiled before anything is timed
          precompiled = engine.compile_shapes(suite.loop.max_tokens - sampler.max_new_tokens)
        for k in in_flight:
          # The same run on other prompts first: the JAX engine compiles its shapes there.
          agentic_run(engine, suite, sampler, args.seed + 1, args.groups, n, sources, k,
                      start=10**6)
          res = agentic_run(engine, suite, sampler, args.seed, args.groups, n, sources, k)
          res.update(startup_s=startup, in_flight=k,
                     compiled_shapes=precompiled or None,
                     compiled_while_timed=engine.compiled_shapes - precompiled if name == "jax"
                     else None)
          out["engines"][name if len(in_flight) == 1 else f"{name}@{k}"] = res
        engine.close()
        continue
      res, groups = {}, None
      if not args.weights_only:
        timed_run(engine, requests(args.seed + 1, args.groups, n, sources, start=10**6))  # warm up
        res, groups = timed_run(engine, reqs)
      res["startup_s"] = startup
      if name in ("jax", "vllm"):
        sync = WeightSyncConfig()
        sync = sync.resolve("local", sync.wire_bytes(params, model_cfg))
        res.update(weight_updates(engine, params, model_cfg, sync, args.updates, tmp))
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None
                                         ) as old:  # the old path at its fastest: files in RAM
          res["old_path"] = weight_updates(engine, params, model_cfg,
                                           dataclasses.replace(sync, transport="files"),
                                           args.updates, old)
      if name == "vllm" and groups is not None:
        res["logprob_max_abs_diff"] = trainer_logprob_diff(model, groups, sampler.temperature, length)
      engine.close()
    out["engines"][name] = res
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=2)
  if agentic:
    print(f"\n{'engine':<10} {'tokens/s':>9} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} "
          f"{'p99/p50':>8} {'busy':>6} {'util':>6} {'turns':>6} {'wall s':>7}")
    for name, r in out["engines"].items():
      g = r["group_time_s"]
      print(f"{name:<10} {r['tokens_per_s']:9.0f} {g['p50']:7.3f} {g['p90']:7.3f} {g['p99']:7.3f} "
            f"{r['p99_over_p50']:8.2f} {r['busy_fraction']:6.3f} {r['engine_utilization']:6.3f} "
            f"{r['turns_per_episode']['mean']:6.2f} {r['wall_s']:7.2f}")
    print(f"wrote {args.json}")
    gin.clear_config()
    return
  print(f"\n{'engine':<11} {'tokens/s':>9} {'first s':>8} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} "
        f"{'p99/p50':>8} {'wall s':>7}")
  for name, r in out["engines"].items():
    if "group_time_s" not in r:  # --weights_only
      continue
    g = r["group_time_s"]
    print(f"{name:<11} {r['tokens_per_s']:9.0f} {r['first_group_s']:8.3f} {g['p50']:7.3f} "
          f"{g['p90']:7.3f} {g['p99']:7.3f} {g['p99'] / g['p50']:8.2f} {r['wall_s']:7.3f}")
  for name in ("jax", "vllm"):
    if name not in out["engines"]:
      continue
    r = out["engines"][name]
    print(f"\n{name} weight update ({r['weight_bytes'] / 1e9:.2f} GB)  publish s  subscribe s  "
          "load s  update s  copy s  update/copy  warm copy s  update/warm"
          + ("  vLLM reload s  rest/warm" if name == "vllm" else ""))
    for label, w in (("shm", r), ("files", r["old_path"])):
      print(f"  {label:<30} {w['publish_s']:9.3f} {w['subscribe_s']:12.3f} {w['load_s']:7.3f} "
            f"{w['weight_update_s']:9.3f} {w['copy_s']:7.3f} {w['weight_update_vs_copy']:12.2f} "
            f"{w['copy_warm_s']:12.3f} {w['weight_update_vs_warm_copy']:12.2f}"
            + (f" {w['engine_processing_s']:14.3f} {w['ours_vs_warm_copy']:10.2f}"
               if name == "vllm" else ""))
  if "logprob_max_abs_diff" in out["engines"].get("vllm", {}):
    print(f"vllm logprob_max_abs_diff {out['engines']['vllm']['logprob_max_abs_diff']:.2e}")
  print(f"wrote {args.json}")
  gin.clear_config()


if __name__ == "__main__":
  main()
