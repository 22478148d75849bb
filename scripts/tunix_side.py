"""The Tunix side of scripts/bench_vs_tunix.py: Tunix 0.1.7 on our workload.

  <tunix venv>/bin/python scripts/tunix_side.py --workload W.json --json OUT.json \
      [--off_policy_steps K]

Runs in Tunix's own venv (bench_vs_tunix.py builds it), never the project's. W.json
is the workload bench_vs_tunix.workload_of wrote from our gin config: model shape,
tasks, G x n, quotas, sampling, optimizer, clip. From the project it imports only
the pure task modules (knittrans_jax.rollout.tasks, agentic_tasks, environment,
data.split: numpy and gin), through this checkout's path.

What Tunix runs, and why each setting (chosen by the sweeps recorded in
docs/vs_tunix.md, traj per CPU-second on this 2-core machine):
  text     GRPOLearner + RLCluster, colocated (actor and rollout share one 1x1 mesh
           with Auto axes; the sampler holds the trainer's Variables: no weight
           sync), the 'vanilla' rollout engine; GRPOConfig(num_generations=n,
           num_iterations=1, beta=0, epsilon=clip_low, loss_agg_mode='token-mean')
           with epsilon_high = clip_high set on the instance (the loss reads it; the
           dataclass has no field); batch sizes in prompts: mini-batch = the step
           (one optimizer step, as ours), train micro-batch = mini-batch (the exact
           token mean: smaller micro-batches average micro-batch means through
           optax.MultiSteps, and were 13% slower), the whole step in one sampler call
           (rollout micro-batch 32 trajectories was 15% slower); kv_cache_size =
           prompt + new tokens (Tunix's default 1024 was 4.3x slower); no CPU
           offload, no reference model; a persistent compilation cache (--jax_cache),
           as our side has one.
  agentic  see `agentic` below.

Patches (monkeypatched here, site-packages untouched), each needed for the workload
to train as ours does:
  1. a fresh sampling key per sampler call: Tunix passes RolloutConfig.seed None ->
     PRNGKey(0) on every call, so every step reuses the same noise;
  2. EOS kept in completions: Tunix cuts each completion before its EOS, so the
     policy gets no gradient on stopping (60 steps: reward 0.07 -> 0.17 unpatched,
     0.06 -> 0.43 patched);
  3. PAD (id 0) never sampled: Tunix treats any 0 in a completion as padding, out
     of attention and loss, so a sampled 0 is never penalised (24% of completions
     held one unpatched); our vocabulary has PAD at 0 too, and our sampler draws it
     like any token, but our loss mask counts it;
  4. the group advantage with the population std (ours) instead of the sample std;
  5. the model initialised as ours (matrices N(0, 0.02), biases 0, norms 1): Tunix's
     Qwen2 init is for loading checkpoints (zero MLP kernels never train; an N(0, 1)
     embedding makes a group's samples identical).

Output JSON: params, step_end_s (seconds since the learner started, after each step),
trajectories, reward (mean per step), response_len (text: mean response tokens per step,
the stop token counted), staleness (mean per step: the step trained
minus the policy version at each trajectory's first token), source_counts, settings,
patches, phases (seconds per phase, steady steps; --phases), import_s (the whole process's
wall is measured by bench_vs_tunix.py around it).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

T_START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse_args():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workload", required=True, help="the JSON bench_vs_tunix.py wrote")
  p.add_argument("--json", required=True)
  p.add_argument("--off_policy_steps", type=int, default=0, help="agentic: Tunix's knob")
  p.add_argument("--jax_cache", default=os.path.join(ROOT, ".cache", "jax-tunix"),
                 help="persistent compilation cache ('' = off)")
  p.add_argument("--phases", action="store_true",
                 help="seconds per phase (rollout, reward, update; adds a sync a phase)")
  p.add_argument("--agentic_engine", choices=("batched", "per_turn"), default="per_turn",
                 help="agentic: coalesce concurrent turns into one sampler call (max_concurrency "
                      "128 / 256 at off_policy_steps 0 / 1), or Tunix's stock one call per turn "
                      "(16 / 32)")
  p.add_argument("--check", action="store_true",
                 help="agentic: replay every trained episode through a fresh AgenticEnv and "
                      "report mismatches (`check` in the JSON)")
  return p.parse_args()


ARGS = parse_args()
with open(ARGS.workload) as f:
  W = json.load(f)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, ROOT)  # the project's pure task modules only
from knittrans_jax.data import split  # noqa: E402
from knittrans_jax.rollout import tasks  # noqa: E402

from tunix.rl import function_registry  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.rl.rollout import vanilla_rollout  # noqa: E402
from tunix_common import (IdTokenizer, ids_to_text, make_model, make_optimizer,  # noqa: E402
                          mesh_1x1, text_to_ids)

T_IMPORTED = time.perf_counter()
absl_logging.set_verbosity(absl_logging.WARNING)
if ARGS.jax_cache:
  jax.config.update("jax_compilation_cache_dir", ARGS.jax_cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

G, N, SEED = W["groups"], W["n"], W["seed"]
QUOTA = W["quota"]
PAD, EOS = tasks.PAD, tasks.EOS
PATCHES: list[str] = []


# ------------------------------------------------------------------ tasks and data

@functools.lru_cache(maxsize=None)
def text_task(group_id: int, source: str) -> tasks.Task:
  """rollout/groups.task_for's text branch (training side of the split)."""
  rng = np.random.default_rng([SEED, group_id])
  for _ in range(1000):
    task = tasks.make_task(rng, source)
    if not split.held_out(source, task.prompt):
      return task
  raise ValueError(f"no training prompt for {source} group {group_id}")


def step_sources(step: int) -> list[str]:
  """One step's sources: the quotas exactly, in an order drawn from (seed, step)."""
  block = [s for s, q in QUOTA.items() for _ in range(q)]
  order = np.random.default_rng([SEED, 7919, step]).permutation(len(block))
  return [block[i] for i in order]


# ------------------------------------------------------------------ patches (module doc)

@function_registry.register_advantage_estimator("grpo")
def _grpo_advantages(rewards: np.ndarray, num_generations: int) -> np.ndarray:
  g = rewards.reshape(-1, num_generations)
  return ((g - g.mean(axis=-1, keepdims=True)) / (g.std(axis=-1, keepdims=True) + 1e-6)).reshape(-1)


PATCHES.append("group advantage with the population std (Tunix: sample std)")
_SAMPLE_KEY = {"base": jax.random.PRNGKey(SEED + 1_000_003), "calls": 0}


def _generate(self, prompts, rollout_config, **kwargs):
  """VanillaRollout.generate with patches 1-3."""
  key = jax.random.fold_in(_SAMPLE_KEY["base"], _SAMPLE_KEY["calls"])
  _SAMPLE_KEY["calls"] += 1
  out = self._sampler(
      input_strings=prompts, max_generation_steps=rollout_config.max_tokens_to_generate,
      max_prompt_length=rollout_config.max_prompt_length, echo=False,
      temperature=rollout_config.temperature, top_p=rollout_config.top_p,
      top_k=rollout_config.top_k, seed=key, pad_output=False,
      eos_tokens=rollout_config.eos_tokens, return_logprobs=rollout_config.return_logprobs,
      forbidden_tokens=[PAD])
  L = rollout_config.max_tokens_to_generate
  # A completion shorter than the limit stopped at an EOS, which Tunix cut: put it back.
  toks = [np.concatenate([t, np.array([EOS], t.dtype)]) if len(t) < L else t for t in out.tokens]
  return base_rollout.RolloutOutput(text=[ids_to_text(t) for t in toks], logits=out.logits,
                                    tokens=toks, left_padded_prompt_tokens=out.padded_prompt_tokens,
                                    logprobs=out.logprobs)


vanilla_rollout.VanillaRollout.generate = _generate
PATCHES += ["a fresh sampling key per sampler call (Tunix: PRNGKey(0) every call)",
            "EOS kept in completions (Tunix cuts it: no gradient on stopping)",
            "PAD (0) never sampled (Tunix masks any 0 in a completion as padding)"]


# ------------------------------------------------------------------ text

def run_text() -> dict:
  steps = W["steps"]
  prompt_len = max(len(text_task(g, s).prompt) for g in range(G) for s in QUOTA)
  prompt_len = max(prompt_len, 5)  # our PROMPT_LEN: every text prompt fits it
  new_tokens = W["sampler"]["max_new_tokens"]
  mesh = mesh_1x1()
  model, params = make_model(W, PATCHES, mesh)
  updates = steps * W["mini_batches"]
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=new_tokens, max_prompt_length=prompt_len,
      temperature=W["sampler"]["temperature"], top_p=W["sampler"]["top_p"], top_k=None,
      kv_cache_size=prompt_len + new_tokens, eos_tokens=[EOS], seed=None)
  mini = G // W["mini_batches"]
  training_config = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=make_optimizer(W, updates), eval_every_n_steps=10**9, max_steps=updates,
      mini_batch_size=mini, train_micro_batch_size=mini,  # prompts, not trajectories
      rollout_micro_batch_size=G, compute_logps_micro_batch_size=G,
      checkpoint_root_directory=None, metrics_logging_options=None, pbar_description=None)
  roles = {r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                             rl_cluster_lib.Role.ROLLOUT)}
  cluster = rl_cluster_lib.RLCluster(
      actor=model, reference=None, tokenizer=IdTokenizer(),
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh=roles, rollout_engine="vanilla", offload_to_cpu=False,
          training_config=training_config, rollout_config=rollout_config))
  algo = grpo_learner.GRPOConfig(num_generations=N, num_iterations=1, beta=0.0,
                                 epsilon=W["loss"]["clip_low"], loss_agg_mode="token-mean")
  algo.epsilon_high = W["loss"]["clip_high"]

  rewards: dict[int, list[float]] = {}
  lengths: dict[int, list[int]] = {}
  sources: dict[int, dict] = {}

  def reward_fn(prompts, completions, group_id, source, **kwargs):
    ids = [text_to_ids(c) for c in completions]
    out = [float(tasks.score(text_task(int(g), str(s)), i))
           for i, g, s in zip(ids, group_id, source)]
    step = cluster.global_steps
    rewards.setdefault(step, []).extend(out)
    lengths.setdefault(step, []).extend(len(i) for i in ids)  # the stop token counted, as ours
    counts = sources.setdefault(step, {})
    for s in source[::N]:  # a group's n rows share their source
      counts[str(s)] = counts.get(str(s), 0) + 1
    return out

  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward_fn])
  if learner.should_sync_weights:
    raise RuntimeError("the colocated Tunix learner syncs weights: rollout does not share the "
                       "trainer's Variables, the comparison's premise")

  def data():
    for step in range(steps):
      srcs = step_sources(step)
      gids = [step * G + i for i in range(G)]
      yield {"prompts": np.array([ids_to_text(text_task(g, s).prompt) for g, s in zip(gids, srcs)],
                                 dtype=object),
             "group_id": np.array(gids, np.int64), "source": np.array(srcs, dtype=object)}

  ends, phases = _time_steps(learner, cluster)
  t0 = time.perf_counter()
  learner.train(data())
  order = sorted(rewards)
  return {"params": params, "step_end_s": [t - t0 for t in ends],
          "trajectories": [len(rewards[s]) for s in order],
          "reward": [float(np.mean(rewards[s])) for s in order],
          "response_len": [float(np.mean(lengths[s])) for s in order],
          "staleness": [0.0 for _ in order],  # on-policy: each step samples with its weights
          "source_counts": [sources[s] for s in order], "phases": phases,
          "settings": {"learner": "GRPOLearner", "rollout_engine": "vanilla",
                       "mini_batch_prompts": mini, "train_micro_batch_prompts": mini,
                       "rollout_micro_batch_prompts": G, "kv_cache_size": prompt_len + new_tokens,
                       "max_prompt_length": prompt_len, "loss_agg_mode": "token-mean",
                       "epsilon": algo.epsilon, "epsilon_high": algo.epsilon_high,
                       "offload_to_cpu": False, "jax_cache": ARGS.jax_cache or None}}


def _time_steps(learner, cluster):
  """Stamps the end of every train step (the actor's state ready); with --phases, the
  seconds of rollout, reward and update calls (each synced)."""
  ends: list[float] = []
  phases: dict[str, float] = {}
  inner = learner._run_global_step

  def timed_step(*a, **kw):
    inner(*a, **kw)
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    ends.append(time.perf_counter())
  learner._run_global_step = timed_step
  if ARGS.phases:
    def timed(name, fn, sync=False):
      def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        if sync:
          jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        if len(ends) >= 1:  # past the first (compiling) step
          phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
        return out
      return wrapper
    cluster.generate = timed("rollout", cluster.generate)
    cluster.update_actor = timed("update", cluster.update_actor, sync=True)
    learner._compute_rewards = timed("reward", learner._compute_rewards)
  return ends, phases


def main():
  if W["suite"] == "text":
    out = run_text()
  elif W["suite"] == "agentic":
    from tunix_agentic import run_agentic  # noqa: E402  (scripts/, beside this file)
    out = run_agentic(W, ARGS, PATCHES)
  else:
    raise ValueError(f"workload suite {W['suite']!r}: this side runs 'text' and 'agentic'")
  out.update(framework="tunix", jax_version=jax.__version__, patches=PATCHES,
             import_s=T_IMPORTED - T_START)
  with open(ARGS.json, "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  main()
