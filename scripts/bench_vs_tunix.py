"""The whole RL loop side by side with Tunix 0.1.7, single-turn and agentic.

  python scripts/bench_vs_tunix.py --json runs/bench_vs_tunix.json
  python scripts/bench_vs_tunix.py --json runs/vs_tunix_dry.json --dry_run   # toy sizes

A benchmark, not a test. Each workload is one of our gin configs
(configs/vs_tunix/{text,agentic}.gin); the Tunix side is built from the same config,
parsed here and handed over as JSON (`workload_of`), so one file says what both run:
the model shape (both sides count their parameters: 304,256), tasks and rewards (the
same generators, knittrans_jax/rollout/tasks.py and agentic_tasks.py, imported by
the Tunix side), G x n per step and the source quotas, sampling, optimizer chain,
clip, token-mean loss, no KL.

  text     ours colocated and ours disaggregated, each against Tunix's GRPOLearner
           (on-policy: Tunix's GRPO has no asynchronous mode; one Tunix run a pair
           serves both ratios)
  agentic  ours colocated against Tunix's agentic GRPO learner at off_policy_steps 0,
           ours disaggregated against it at off_policy_steps 1

Tunix runs in its own venv (--venv, built by this script when missing: google-tunix
0.1.7 and gin-config, never in the project's venv) through scripts/tunix_side.py,
which lists every patch it applies and why, and every setting with the sweep that
chose it. --pairs alternating pairs per workload (the order inside a pair flips each
pair); the one-minute load average is logged before every run; nothing else should
run on the machine.

Figures, per run: steady-state trajectories per second (trajectories of the steps
after --warmup_steps over the time from the end of that step to the end of the
last), the whole process's wall (measured here, interpreter start to exit), reward
per step, mean response tokens per step (the two policies learn differently, and a
longer response is more work a trajectory: text, both sides), staleness per step (the version trained minus the policy version at each
trajectory's first token, the same definition on both sides) and quota violations
(steps whose source counts differ from the quotas). JSON: `text.ratio_steady` and
`agentic.ratio_steady` (median over pairs of ours / Tunix, disaggregated pair),
`*.colocated.ratio_steady`, `*.<mode>.ratio_steady_response_tokens` (the same ratio in
response tokens per second), each pair's runs, ratios and loads. The policies learn
differently (on text ours answers in a few tokens where Tunix's keeps ~15), so a
trajectory is not the same work on both sides; `--fixed_policy` workloads (text by
default) run their pairs again with the policy held at its initialisation on both
sides (`FIXED_POLICY`), where it is: `text.fixed_policy.<mode>.ratio_steady`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from knittrans_jax.bench.timing import steady_rate
from knittrans_jax.bench.venvs import ensure_venv, venv_python

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TUNIX_VERSION = "0.1.7"
# What the Tunix venv holds beside Tunix (which brings JAX, Flax, Optax and Grain):
# gin-config, which the project's agentic task module imports.
TUNIX_DEPS = [f"google-tunix=={TUNIX_VERSION}", "gin-config==0.5.0"]
TUNIX_STAMP = ".installed-tunix"  # in the venv once its install finished
CONFIGS = {"text": "configs/vs_tunix/text.gin", "agentic": "configs/vs_tunix/agentic.gin"}
# The pairs each workload runs: (our mode, Tunix's off_policy_steps).
PAIRS = {"text": (("colocated", 0), ("disaggregated", 0)),
         "agentic": (("colocated", 0), ("disaggregated", 1))}
# --dry_run: toy sizes, a few steps (the suite's smoke run).
# The policy held at its initialisation on both sides (a learning rate of 1e-9; every
# step still computes and applies its update): the two sides then sample from the same
# distribution, so a trajectory is the same work on both, whatever either learner would
# have learned (the learning runs' answers differ in length: see response_len).
FIXED_POLICY = "OptimizerConfig.learning_rate = 1e-9"
DRY = {"text": ["TrainBatchSpec.group_size = 4", "TrainBatchSpec.groups_per_batch = 4",
                "TrainBatchSpec.source_quota = {'nearest': 2, 'count': 1, 'chain': 1}"],
       "agentic": ["TrainBatchSpec.group_size = 4", "TrainBatchSpec.groups_per_batch = 4",
                   "TrainBatchSpec.source_quota = {'hop': 2, 'nearest': 2}",
                   "ToolLatency.median_s = 0.01", "ToolLatency.max_s = 0.05"]}


# ------------------------------------------------------------------ the workload, once

def workload_of(name: str, bindings: list[str], steps: int) -> dict:
  """What both sides run, from our gin config (JSON-able: the Tunix side's input)."""
  import dataclasses

  import gin

  from knittrans_jax import cli
  from knittrans_jax.admission.spec import TrainBatchSpec
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.models.decoder import DecoderConfig
  from knittrans_jax.rl.losses import LossConfig
  from knittrans_jax.rollout.sampler import SamplerConfig
  from knittrans_jax.train.optimizer import OptimizerConfig
  cli.register_configurables()
  gin.clear_config()
  gin.parse_config_files_and_bindings([os.path.join(ROOT, CONFIGS[name])], bindings)
  job, spec = JobConfig(), TrainBatchSpec()
  out = {"workload": name, "steps": steps, "seed": job.seed, "suite": job.suite,
         "groups": spec.groups_per_batch, "n": spec.group_size,
         "quota": dict(spec.source_quota), "mini_batches": spec.num_mini_batches,
         "seq_len": job.seq_len,
         "model": dataclasses.asdict(DecoderConfig()),
         "sampler": dataclasses.asdict(SamplerConfig()),
         "optimizer": dataclasses.asdict(OptimizerConfig().for_steps(
             steps * spec.num_mini_batches)),
         "loss": dataclasses.asdict(LossConfig())}
  if job.suite == "agentic":
    from knittrans_jax.rollout.agent_loop import AgentConfig
    from knittrans_jax.rollout.agentic_tasks import AgenticTaskConfig
    out["agent"] = dataclasses.asdict(AgentConfig())
    out["agentic_tasks"] = dataclasses.asdict(AgenticTaskConfig())
  return out


# ------------------------------------------------------------------ running one side

def _load() -> float:
  return os.getloadavg()[0]


def steady(step_end_s: list[float], trajectories: list[int], warmup: int) -> float:
  """Trajectories per second over the steps after the first `warmup`."""
  if len(step_end_s) <= warmup + 1:
    raise ValueError(f"{len(step_end_s)} steps: not more than the {warmup} warm-up steps + 1")
  return steady_rate(step_end_s, trajectories, warmup)


def run_ours(name: str, mode: str, bindings: list[str], steps: int, warmup: int,
             timeout: float, src: str) -> dict:
  """Our job in its own process (scripts/train.py), its figures from metrics.jsonl."""
  from knittrans_jax.job.metrics import read_metrics
  with tempfile.TemporaryDirectory(prefix="vs_tunix_ours_") as workdir:
    cmd = [sys.executable, os.path.join(src, "scripts", "train.py"), "--gin_file",
           os.path.join(src, CONFIGS[name]), "--workdir", workdir, "--overwrite",
           "--gin_bindings", f"JobConfig.train_batches = {steps}",
           "--gin_bindings", f"JobConfig.mode = '{mode}'"]
    for b in bindings:
      cmd += ["--gin_bindings", b]
    env = {**os.environ, "PYTHONPATH": src, "JAX_PLATFORMS": "cpu"}
    load, t0 = _load(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode:
      raise RuntimeError(f"our {name} run ({mode}) failed:\n{proc.stderr[-4000:]}")
    recs = read_metrics(workdir)
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  ends = [r["time_s"] for r in recs]
  trajs = [r["trajectories"] for r in recs]
  return {"side": "ours", "mode": mode, "load_before": load, "process_wall_s": wall,
          "steady_traj_per_s": steady(ends, trajs, warmup), "steps": len(recs),
          "step_end_s": ends, "reward": [r["reward"] for r in recs],
          "response_len": [r["response_len"] for r in recs],
          "response_len_steady": statistics.fmean(r["response_len"] for r in recs[warmup:]),
          "staleness": [r["arch_staleness_mean"] for r in recs],
          "staleness_mean": summary["arch_staleness_mean"],
          "quota_violations": summary["quota_violations"],
          "source_counts": [r["source_counts"] for r in recs]}


def run_tunix(python: str, workload: dict, off_policy_steps: int, warmup: int,
              timeout: float, src: str, engine: str = "per_turn") -> dict:
  """Tunix in its venv (scripts/tunix_side.py), the same workload."""
  with tempfile.TemporaryDirectory(prefix="vs_tunix_tx_") as tmp:
    spec, out = os.path.join(tmp, "workload.json"), os.path.join(tmp, "out.json")
    with open(spec, "w") as f:
      json.dump(workload, f)
    cmd = [python, os.path.join(src, "scripts", "tunix_side.py"), "--workload", spec,
           "--off_policy_steps", str(off_policy_steps), "--json", out,
           "--agentic_engine", engine]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    load, t0 = _load(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode:
      raise RuntimeError(f"the Tunix {workload['workload']} run (off_policy_steps "
                         f"{off_policy_steps}) failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
      res = json.load(f)
  quota = workload["quota"]
  violations = sum(1 for c in res["source_counts"] if c != quota)
  lengths = res.get("response_len")  # the text side's; the agentic side has none
  return {"side": "tunix", "off_policy_steps": off_policy_steps, "load_before": load,
          "response_len_steady": statistics.fmean(lengths[warmup:]) if lengths else None,
          "process_wall_s": wall, "steps": len(res["step_end_s"]),
          "steady_traj_per_s": steady(res["step_end_s"], res["trajectories"], warmup),
          "quota_violations": violations,
          "staleness_mean": statistics.fmean(res["staleness"]) if res["staleness"] else None,
          **{k: res[k] for k in ("step_end_s", "reward", "staleness", "source_counts",
                                 "params", "settings", "patches", "response_len") if k in res}}


def ensure_tunix_venv(venv: str) -> str:
  """The Tunix venv's python, building the venv first when missing (uv, under this
  machine's pip configuration: scripts/uv_install.py)."""
  return ensure_venv(
      venv, TUNIX_STAMP, f"building the Tunix {TUNIX_VERSION} venv in {venv} (a few minutes)...",
      [["-m", "pip", "install", "-q", "uv==0.13.8"],
       [os.path.join(HERE, "uv_install.py"), "-q", *TUNIX_DEPS]],
      "import importlib.metadata as m, jax; print(m.version('google-tunix'), jax.__version__)",
      stamp_text=lambda out: out,
      ready=lambda out: f"Tunix venv ready (google-tunix, jax: {out.strip()})")


def tunix_python(venv: str) -> str | None:
  """The Tunix venv's python if it is installed, else None (tests skip on None)."""
  return venv_python(venv, TUNIX_STAMP)


# ------------------------------------------------------------------ pairs and the JSON

def run_workload(name: str, args, tunix_py: str) -> dict:
  """The workload's pairs as they learn; with the workload in --fixed_policy, the same
  pairs again with the policy held at its initialisation (`fixed_policy`)."""
  bindings = (DRY[name] if args.dry_run else []) + list(args.gin_bindings or [])
  out = run_pairs(name, bindings, args, tunix_py)
  if name in args.fixed_policy.split(","):
    out["fixed_policy"] = run_pairs(name, bindings + [FIXED_POLICY], args, tunix_py)
  return out


def run_pairs(name: str, bindings: list[str], args, tunix_py: str) -> dict:
  steps = args.steps or (3 if args.dry_run else {"text": 60, "agentic": 20}[name])
  warmup = args.warmup_steps if args.warmup_steps is not None else (1 if args.dry_run else 5)
  workload = workload_of(name, bindings, steps)
  fixed = FIXED_POLICY in bindings
  pairs = []
  for p in range(args.pairs):
    runs = {}
    jobs = [("ours", mode) for mode, _ in PAIRS[name]]
    jobs += sorted({("tunix", off) for _, off in PAIRS[name]})
    if p % 2:
      jobs.reverse()  # Tunix first every other pair
    for side, what in jobs:
      desc = (f"{name}{' (fixed policy)' if fixed else ''} pair {p + 1}/{args.pairs}: "
              f"{side} {what}")
      print(f"{desc} (load {_load():.2f}) ...", file=sys.stderr, flush=True)
      if side == "ours":
        runs[("ours", what)] = run_ours(name, what, bindings, steps, warmup, args.timeout,
                                        args.ours_src)
      else:
        runs[("tunix", what)] = run_tunix(tunix_py, workload, what, warmup, args.timeout,
                                          args.ours_src, args.tunix_agentic_engine)
      r = runs[(side, what)]
      length = r["response_len_steady"]
      print(f"  {r['steady_traj_per_s']:.1f} traj/s steady, {r['process_wall_s']:.1f} s "
            f"process, staleness {r['staleness_mean']}"
            + (f", {length:.1f} response tokens" if length is not None else ""),
            file=sys.stderr, flush=True)
    pair = {"runs": [runs[k] for k in sorted(runs, key=str)], "ratios": {}}
    for mode, off in PAIRS[name]:
      ours, tx = runs[("ours", mode)], runs[("tunix", off)]
      pair["ratios"][mode] = {
          "ratio_steady": ours["steady_traj_per_s"] / tx["steady_traj_per_s"],
          "ratio_process_wall": tx["process_wall_s"] / ours["process_wall_s"],
          "staleness_ours": ours["staleness_mean"], "staleness_tunix": tx["staleness_mean"],
          # Trajectories differ in length as the two policies learn differently: the
          # mean response tokens of the steady steps say how much work a trajectory was.
          "response_len_ours": ours["response_len_steady"],
          "response_len_tunix": tx["response_len_steady"],
          "ratio_steady_response_tokens": (
              ours["steady_traj_per_s"] * ours["response_len_steady"]
              / (tx["steady_traj_per_s"] * tx["response_len_steady"])
              if tx["response_len_steady"] else None),
          "quota_violations_ours": ours["quota_violations"],
          "quota_violations_tunix": tx["quota_violations"],
          "tunix_off_policy_steps": off}
    pairs.append(pair)
  out = {"workload": workload, "warmup_steps": warmup, "pairs": pairs}
  for mode, _ in PAIRS[name]:
    values = [p["ratios"][mode]["ratio_steady"] for p in pairs]
    out[mode] = {"ratio_steady": statistics.median(values), "range": [min(values), max(values)],
                 "per_pair": values}
    tokens = [p["ratios"][mode]["ratio_steady_response_tokens"] for p in pairs]
    if None not in tokens:
      out[mode]["ratio_steady_response_tokens"] = statistics.median(tokens)
  out["ratio_steady"] = out["disaggregated"]["ratio_steady"]
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--json", required=True)
  p.add_argument("--workloads", default="text,agentic")
  p.add_argument("--pairs", type=int, default=3)
  p.add_argument("--steps", type=int, default=None,
                 help="train steps a run (default: text 60, agentic 20; --dry_run 3)")
  p.add_argument("--warmup_steps", type=int, default=None,
                 help="steps left out of the steady rate (default 5; --dry_run 1)")
  p.add_argument("--gin_bindings", action="append", help="more bindings, both sides")
  p.add_argument("--venv", default=os.path.join(ROOT, ".cache", "venv-tunix"))
  p.add_argument("--ours_src", default=ROOT,
                 help="the checkout our side runs (an A/B of a change: another checkout)")
  p.add_argument("--timeout", type=float, default=900, help="seconds for any one run")
  p.add_argument("--tunix_agentic_engine", choices=("per_turn", "batched"), default="per_turn",
                 help="per_turn: Tunix's own rollout (a sampler call per turn); batched: "
                      "scripts/tunix_agentic.py's engine joining concurrent turns into one "
                      "call, which is ours, not Tunix's (a stronger peer than Tunix ships)")
  p.add_argument("--fixed_policy", default="text",
                 help="workloads whose pairs run again with the policy held at its "
                      "initialisation on both sides (equal work a trajectory); '' for none")
  p.add_argument("--dry_run", action="store_true", help="toy sizes, one pair, 3 steps")
  args = p.parse_args()
  if args.dry_run:
    args.pairs = 1
  names = args.workloads.split(",")
  for name in names:
    if name not in CONFIGS:
      p.error(f"--workloads: {name!r} is not one of {sorted(CONFIGS)}")
  for name in filter(None, args.fixed_policy.split(",")):
    if name not in CONFIGS:
      p.error(f"--fixed_policy: {name!r} is not one of {sorted(CONFIGS)}")
  tunix_py = ensure_tunix_venv(os.path.abspath(args.venv))
  t0 = time.perf_counter()
  out = {"machine": {"nproc": len(os.sched_getaffinity(0)), "load_at_start": _load()},
         "tunix_version": TUNIX_VERSION, "dry_run": args.dry_run,
         "tunix_agentic_engine": args.tunix_agentic_engine}
  for name in names:
    out[name] = run_workload(name, args, tunix_py)
  out["wall_s"] = time.perf_counter() - t0
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  for name in names:
    for label, w in ((name, out[name]), (f"{name}, fixed", out[name].get("fixed_policy"))):
      for mode, _ in PAIRS[name] if w else ():
        r = w[mode]
        tokens = r.get("ratio_steady_response_tokens")
        print(f"{label:15s} {mode:14s} ours/Tunix steady {r['ratio_steady']:.2f} "
              f"(pairs {', '.join(f'{v:.2f}' for v in r['per_pair'])})"
              + (f", response tokens/s {tokens:.2f}" if tokens is not None else ""))
  print(f"wrote {args.json} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
  main()
