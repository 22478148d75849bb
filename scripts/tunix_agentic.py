"""The agentic side of scripts/tunix_side.py: Tunix 0.1.7's agentic GRPO learner
(tunix/rl/agentic/agentic_grpo_learner.py) on our 'agentic' workload W.

Each episode is a Tunix BaseTaskEnv around our AgenticEnv (groups.task_for's task, our
episode index = Tunix's pair_index: the same latency draws). Text is the ids as decimals
under a template-free chat parser: turns train with mask 1, observations with mask 0
(trajectory_collect_engine.py:618-634); the env's summed step rewards are the episode's
(reward_manager.py:221-268). Actor and rollout share one 1x1 mesh (no weight sync).
Paths are under tunix/; each patch was run off once to see its fault.

Patches (monkeypatched, site-packages untouched):
  1. a seed per turn, ours: Tunix passes RolloutConfig.seed None -> PRNGKey(0) on every
     call (vanilla_rollout.py:62, sampler.py:835-838), and a group's episodes share prompt
     and env: 16/16 groups had n identical episodes, reward 0. The batched engine keys
     each call afresh instead (rows sample independently, sampler.py:522).
  2. a turn asks for min(max_new_tokens, remaining) and the env ends episodes by our budget
     rule (agent_loop.py:_answer): Tunix asks each turn for all the budget left (trajectory_
     collect_engine.py:499-503): turns of up to 74 tokens, a 1-step run 304 s (65-90).
  3. EOS kept: the sampler cuts a turn before its EOS (sampler.py:943-950), out of the
     trained tokens, logprobs and next context; the env saw no turn stop (0/229). The
     sampler's `utils` is proxied: np_find_first_eos_idx returns idx + 1.
  4. warm-up: every sampler program once, on a fresh thread, through cluster.generate (its
     mesh context keys the jit cache), before train(): threads compiling one program at
     once segfault (3/3 cold, 0 warmed; warmed outside the mesh: 2/2 "Mutex corrupt").
  5. ordered consumer: Tunix trains groups in finishing order (agentic_rl_learner.py
     :684-693) from a queue of off_policy_steps + 1 batches, the staleness filter off
     (:829-836): at op 1, 7/10 steps broke the quotas, staleness up to 8. Step k now
     trains batch k while k + 1 rolls out (a no-op at op 0).
  6. step rewards added in turn order (ours): np.sum (trajectory_collect_engine.py:684-686)
     is an ulp off on some episodes (1/512).
  7. population-std advantage (ours); Tunix's 'grpo' has ddof=1 (algo_core.py:560-566).
  8. (tunix_common.make_model) the model initialised as ours.
Staleness is measured here: with shared weights Tunix never bumps policy_version
(agentic_rl_learner.py:1054-1055); each episode's first-turn global step is recorded, and
its row key rides to the trainer in TrainExample.policy_version (unused unpacked).

Settings (the probe's sweep, measured on a loaded 2-core machine, +-20 % run to run;
steady episodes/s, 10 steps, all patches and the check on):
  - the batching engine (default): Tunix makes one 1-prompt sampler call per turn
    (agentic_rl_learner.py:455); a BaseRollout subclass (rl_cluster.py:460-486) joins the
    calls of a 2 ms window into one, padded to (8|32|128) x (16|max_tokens): six programs.
    57.8 eps/s at op 0, 67.0 at op 1; per turn (--agentic_engine per_turn) 40.3 / 50.4.
  - max_concurrency (episodes in flight; mc + 1 executor threads for model and env calls,
    agentic_rl_learner.py:236-241): batched 128 / 256 at op 0 / 1 (one batch, two), per
    turn 16 / 32 (16-32: 32-38 eps/s; 64-128: 26-30).
  - no sampler-vs-trainer diagnostic pass (the probe's --no_diag_logps): a trainer forward
    per group inline on the event-loop thread (agentic_grpo_learner.py:437-455), feeding
    only logged metrics (sampler_is None): 20.3 -> 39.8 eps/s.
  - mini-batch G // mini_batches groups = train micro-batch (the exact token mean), token-
    mean loss (Tunix's default: sequence-mean-token-mean), beta 0, epsilon(_high) = clip;
    kv_cache_size = the longest padded context + max_new_tokens (per turn the sampler pads
    to a power of 2, sampler.py:815-816); max_response_length = max_tokens - prompt.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import faulthandler
import functools
import time

import jax
import numpy as np
from flax import nnx

from knittrans_jax.rollout import tasks
from tunix.generate import sampler as sampler_mod
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.agentic import agentic_grpo_learner as agl
from tunix.rl.agentic.trajectory import trajectory_collect_engine as tce
from tunix.rl.rollout import base_rollout
# Beside this file in scripts/ (Tunix's venv has no knittrans_jax but its task modules).
from tunix_agentic_env import IdParser, KnitAgenticEnv, Run, check, response_seeds, turn_seed
from tunix_agentic_patches import EosInclusiveUtils, in_order_reward
from tunix_common import IdTokenizer, ids_to_text, make_model, make_optimizer, mesh_1x1
from tunix_rollouts import BATCH_BUCKETS, WINDOW_S, BatchingRollout, StockRollout

class Learner(agl.GRPOLearner):
  """GRPOLearner with patches 1, 2, 5 and the staleness records; `run` set after init."""
  run: Run

  def _model_call(self, chat_lists, env=None, max_generation_steps=None):
    run = self.run
    if isinstance(env, KnitAgenticEnv):
      if env.turn == 0:  # the step whose weights the episode starts on
        with run.lock:
          run.rec.setdefault(run.key(env.gid, env.pair), {}).update(
              gid=env.gid, pair=env.pair, source=env.source, v0=self.rl_cluster.global_steps)
      run.tls.seed = turn_seed(env.seed_i, env.turn)
      env.turn += 1
      if max_generation_steps is not None:
        max_generation_steps = min(run.max_new, max_generation_steps)
    try:
      return super()._model_call(chat_lists, env, max_generation_steps)
    finally:
      run.tls.seed = None

  def _data_consumer_batch_generator(self, queue, batch_size):
    """Patch 5: batch k's groups (in finishing order) before any of batch k + 1."""
    G, n = self.run.G, self.run.n
    buf, cur, taken = collections.defaultdict(list), self.rl_cluster.global_steps, 0
    while True:
      while len(buf[cur]) >= batch_size:
        out, buf[cur] = buf[cur][:batch_size], buf[cur][batch_size:]
        taken += batch_size
        if taken == G:
          cur, taken = cur + 1, 0
        yield out
      item = queue.get(block=True)
      if item is None:
        rest = [x for b in sorted(buf) for x in buf[b]]
        for i in range(0, len(rest), batch_size):
          yield rest[i:i + batch_size]
        return
      buf[int(np.asarray(item.policy_version)[0]) // n // G].append(item)

  def _process_results(self, trajectories, mode=rl_cluster_lib.Mode.TRAIN, expected_step=None):
    out = super()._process_results(trajectories, mode, expected_step)
    run, keys = self.run, []
    for item in trajectories:
      t = item.traj
      k = run.key(int(t["original_input"]["gid"]), item.pair_index)
      keys.append(k)
      with run.lock:
        r = run.rec.setdefault(k, {})
        r.update(reward=float(t["trajectory_reward"]), status=str(t["status"]))
        if run.check:
          r["tokens"] = np.asarray(t["conversation_tokens"]).tolist()
          r["mask"] = np.asarray(t["conversation_masks"]).tolist()
    # The row keys ride in policy_version to the trainer (the module doc).
    return [ex.replace(policy_version=np.asarray(keys, np.int32)) for ex in out]


def run_agentic(W, args, patches) -> dict:
  faulthandler.enable()  # a crash in a rollout thread prints its stack
  run = Run(W, args.check)
  G, n, steps, op = run.G, run.n, W["steps"], args.off_policy_steps
  if G % W["mini_batches"]:
    raise ValueError(f"{G} groups do not split into {W['mini_batches']} mini-batches")
  mini = G // W["mini_batches"]
  batched = args.agentic_engine == "batched"
  mc = (128 if batched else 16) * (op + 1)
  prompt_len = max(len(run.task(s * G + j, src).prompt)
                   for s in range(steps) for j, src in enumerate(run.step_sources(s)))
  ctx_max = run.max_tokens - run.max_new  # the longest context a turn starts from
  if ctx_max < prompt_len:
    raise ValueError("agent.max_tokens leaves no room for a turn of max_new_tokens")
  max_response = run.max_tokens - prompt_len  # Tunix counts the response alone
  len_buckets = tuple(sorted({min(16, run.max_tokens), run.max_tokens}))
  padded = run.max_tokens if batched else 1 << (ctx_max - 1).bit_length()
  kv_cache = -(-(max(padded, prompt_len) + run.max_new) // 8) * 8

  # tunix_side's module-level entries describe its text-path VanillaRollout.generate,
  # which this module's rollout classes bypass: the list starts afresh.
  patches.clear()
  sampler_mod.utils = EosInclusiveUtils()
  tce.TrajectoryCollectEngine.compute_trajectory_reward = in_order_reward
  patches += [
      "a seed per turn, ours (Tunix: PRNGKey(0) every call: a group's episodes identical)",
      "a turn asks min(max_new_tokens, remaining) + our end-of-budget rule (Tunix: all left)",
      "EOS kept in turns (Tunix's sampler cuts it: lost from context, env and training)",
      "warm-up on a fresh thread through cluster.generate (concurrent compiles segfault)",
      "step k trains batch k (Tunix: groups in finishing order, unbounded staleness)",
      "step rewards summed in turn order, ours (Tunix's np.sum differs by an ulp)",
      "group advantage with the population std, ours (Tunix: sample std)"]

  mesh = mesh_1x1()
  model, params = make_model(W, patches, mesh)
  rollout_cfg = base_rollout.RolloutConfig(
      max_tokens_to_generate=max_response, temperature=W["sampler"]["temperature"],
      top_p=W["sampler"]["top_p"], top_k=None, max_prompt_length=prompt_len,
      kv_cache_size=kv_cache, eos_tokens=list(W["sampler"]["stop_tokens"]),
      return_logprobs=True, seed=None)
  engine = (functools.partial(BatchingRollout, len_buckets=len_buckets,
                              seed=response_seeds(run.seed, 1 << 20, 1)[0])
            if batched else StockRollout)
  cluster = rl_cluster_lib.RLCluster(
      actor=model, reference=None, tokenizer=IdTokenizer(),
      cluster_config=rl_cluster_lib.ClusterConfig(
          role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                          rl_cluster_lib.Role.ROLLOUT)},
          rollout_engine=engine, offload_to_cpu=False,
          training_config=rl_cluster_lib.RLTrainingConfig(
              actor_optimizer=make_optimizer(W, steps * W["mini_batches"]),
              eval_every_n_steps=10**9, max_steps=steps, mini_batch_size=mini,
              train_micro_batch_size=mini,  # groups, not trajectories
              checkpoint_root_directory=None, metrics_logging_options=None,
              pbar_description=None),
          rollout_config=rollout_cfg))
  algo = agl.GRPOConfig(
      num_generations=n, num_iterations=1, beta=0.0, epsilon=W["loss"]["clip_low"],
      epsilon_high=W["loss"]["clip_high"], loss_agg_mode="token-mean",
      advantage_estimator="grpo_pop_std", max_response_length=max_response,
      max_concurrency=mc, off_policy_steps=op, episode_timeout=600.0)
  learner = Learner(rl_cluster=cluster, algo_config=algo, chat_parser=IdParser(IdTokenizer()),
                    env_class=KnitAgenticEnv, env_kwargs={"run": run})
  learner.run = run
  if learner.should_sync_weights:
    raise RuntimeError("the colocated learner syncs weights: rollout does not share the "
                       "trainer's Variables, the comparison's premise")

  ro, generate = cluster.rollout, cluster.rollout.generate

  def seeded_generate(prompts, rollout_config, **kw):  # patch 1
    s = getattr(run.tls, "seed", None)
    if s is not None:
      rollout_config = dataclasses.replace(rollout_config, seed=s)
    return generate(prompts, rollout_config, **kw)
  ro.generate = seeded_generate
  # Tunix's per-group sampler-vs-trainer forward pass feeds only logged metrics here.
  cluster.get_actor_per_token_logps = lambda **kw: None

  ends, update_calls, update = [], [0], cluster.update_actor

  def timed_update(train_ds, eval_ds, skip_jit=False):
    for ex in train_ds:
      run.step_rows[cluster.global_steps] += np.asarray(ex.policy_version).tolist()
    res = update(train_ds, eval_ds, skip_jit)
    update_calls[0] += 1
    if update_calls[0] % W["mini_batches"] == 0:  # the step's last optimizer step
      jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param))
      ends.append(time.perf_counter())
    return res
  cluster.update_actor = timed_update

  # Patch 4: every program the run will use, once, on a fresh thread.
  def warm():
    if batched:
      shapes = [(B, L) for L in len_buckets for B in BATCH_BUCKETS]
    else:  # the sampler pads a context to prompt_len or the next power of 2
      p, lens = 1 << (prompt_len - 1).bit_length(), [prompt_len]
      while p + 1 <= ctx_max:
        lens.append(p + 1)
        p *= 2
      shapes = [(1, L) for L in lens]
    for B, L in shapes:
      cluster.generate(prompts=[ids_to_text([tasks.BOS] + [tasks.SEP] * (L - 1))] * B,
                       apply_chat_template=False, max_generation_steps=run.max_new)
  t_warm = time.perf_counter()
  with cf.ThreadPoolExecutor(1) as pool:
    pool.submit(warm).result()
  t_warm = time.perf_counter() - t_warm
  if batched:
    ro.batches.clear()

  def dataset():
    for s in range(steps):
      yield {"prompts": [""] * G, "gid": [s * G + j for j in range(G)],
             "source": run.step_sources(s)}

  t0 = time.perf_counter()
  learner.train(dataset())
  if len(ends) != steps:
    raise RuntimeError(f"{len(ends)} train steps ended, the workload asked {steps}")

  out = {"params": params, "step_end_s": [t - t0 for t in ends], "trajectories": [],
         "reward": [], "staleness": [], "source_counts": [], "staleness_hist": [],
         "phases": {}}
  for s in sorted(run.step_rows):
    recs = [run.rec[k] for k in run.step_rows[s]]
    out["trajectories"].append(len(recs))
    out["reward"].append(float(np.mean([r["reward"] for r in recs])))
    lag = [s - r["v0"] for r in recs]
    out["staleness"].append(float(np.mean(lag)))
    out["staleness_hist"].append({str(a): b for a, b in sorted(collections.Counter(lag).items())})
    gids = {(r["gid"], r["source"]) for r in recs}
    out["source_counts"].append({src: sum(x == src for _, x in gids) for src in run.quota})
  out["quota_violations"] = sum(c != run.quota for c in out["source_counts"])
  out.update(warmup_s=t_warm, batch_shapes=dict(ro.batches) if batched else None)
  out["settings"] = {
      "learner": "agentic GRPOLearner", "agentic_engine": args.agentic_engine,
      "rollout_engine": "BatchingRollout" if batched else "vanilla (one call per turn)",
      "batch_window_ms": WINDOW_S * 1e3 if batched else None,
      "batch_buckets": list(BATCH_BUCKETS) if batched else None,
      "len_buckets": list(len_buckets) if batched else None,
      "max_concurrency": mc, "off_policy_steps": op, "ordered_consumer": True,
      "diag_logps": "skipped (--no_diag_logps)", "mini_batch_groups": mini,
      "train_micro_batch_groups": mini, "optimizer_steps": steps * W["mini_batches"],
      "max_prompt_length": prompt_len, "max_response_length": max_response,
      "max_tokens_per_turn": run.max_new, "kv_cache_size": kv_cache,
      "loss_agg_mode": "token-mean", "beta": 0.0, "epsilon": algo.epsilon,
      "epsilon_high": algo.epsilon_high, "advantage_estimator": "grpo_pop_std",
      "episode_timeout_s": algo.episode_timeout, "offload_to_cpu": False,
      "shared_weights": True, "jax_cache": args.jax_cache or None}
  if args.check:
    out["check"] = check(run)
  return out
