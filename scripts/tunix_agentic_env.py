"""The episodes of scripts/tunix_agentic.py (Tunix's venv): one run's workload and records
(`Run`), our AgenticEnv as a Tunix BaseTaskEnv ending episodes by our budget rule (patch
2), a template-free chat parser, and `check`, the replay of every trained episode.
Imported by path from scripts/; from the project only the pure task modules."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np
from tunix.rl.agentic.agents import agent_types
from tunix.rl.agentic.environments import base_environment
from tunix.rl.agentic.parser.chat_template_parser import parser as ctp
from tunix_common import ids_to_text

from knittrans_jax.rollout import agentic_tasks, tasks


def response_seeds(seed, group_id, n):  # = knittrans_jax/rollout/engine.py:response_seeds
  st = np.random.SeedSequence([seed, group_id]).generate_state(n, np.uint32)
  return tuple(int(s) >> 1 for s in st)


def turn_seed(seed, turn):  # = knittrans_jax/rollout/agent_loop.py:turn_seed
  if turn == 0:
    return seed
  return int(np.random.SeedSequence([seed, turn]).generate_state(1, np.uint32)[0]) >> 1


class Run:
  """One run's workload and the records its env, learner and hooks share."""

  def __init__(self, W, check):
    self.G, self.n, self.seed, self.quota = W["groups"], W["n"], W["seed"], W["quota"]
    t = dict(W["agentic_tasks"])
    t["latency"] = agentic_tasks.ToolLatency(**t["latency"])
    self.task_cfg = agentic_tasks.AgenticTaskConfig(**t)
    if self.task_cfg.fault_rate:  # ours fails and retries such groups: no Tunix path
      raise ValueError("agentic_tasks.fault_rate > 0: the Tunix side runs without faults")
    if W["sampler"]["greedy"]:
      raise ValueError("sampler.greedy: the Tunix side samples (temperature, top_p)")
    self.max_new = W["sampler"]["max_new_tokens"]
    self.max_turns, self.max_tokens = W["agent"]["max_turns"], W["agent"]["max_tokens"]
    self.check = check
    self.rec: dict[int, dict] = {}  # row key -> the episode's record
    self.lock = threading.Lock()
    self.tls = threading.local()  # the seed of the turn this thread generates
    self.step_rows = collections.defaultdict(list)  # step -> the row keys it trained

  def key(self, gid, pair):
    return int(gid) * self.n + int(pair)

  def task(self, gid, source):
    """groups.task_for, a training group: drawn again while held out."""
    rng = np.random.default_rng([self.seed, gid])
    for _ in range(1000):
      t = agentic_tasks.make_task(rng, source, self.task_cfg)
      if not agentic_tasks.held_out(t):
        return t
    raise ValueError(f"no training prompt for {source} group {gid}")

  def step_sources(self, step):
    """The quotas exactly, in an order drawn from (seed, step), as the text side's."""
    block = [s for s, q in self.quota.items() for _ in range(q)]
    order = np.random.default_rng([self.seed, 7919, step]).permutation(len(block))
    return [block[i] for i in order]


class IdParser(ctp.BaseChatTemplateParser):
  """No template: a conversation is its messages' ids joined (system prompt empty)."""

  def _init_tokens(self):
    return ctp.TokenConfig(message_separator=" ")

  def _init_generation_prompt(self):
    return ""


class KnitAgenticEnv(base_environment.BaseTaskEnv):
  """One episode of our AgenticEnv; ends it as agent_loop.py:_answer does: env done,
  max_turns, or no room for another full turn within max_tokens (patch 2)."""

  def __init__(self, single_example, *, group_id, pair_index, run, **kw):
    ex = {k: (v[0] if isinstance(v, np.ndarray) else v) for k, v in single_example.items()}
    self.run, self.gid, self.source = run, int(ex["gid"]), str(ex["source"])
    self.pair, self.turn, self.ctx, self.walls = int(pair_index), 0, 0, []
    self.ktask = run.task(self.gid, self.source)
    self.inner = agentic_tasks.AgenticEnv(self.ktask, self.pair, run.task_cfg)
    self.seed_i = response_seeds(run.seed, self.gid, run.n)[self.pair]
    super().__init__(task=dict(single_example), max_steps=run.max_turns,
                     group_id=group_id, pair_index=pair_index)

  def _initial_observation(self):
    prompt = self.inner.reset(self.ktask)
    self.ctx = len(prompt)
    return {"prompts": ids_to_text(prompt), "gid": self.gid, "source": self.source}

  def _step_impl(self, action):
    if isinstance(action, agent_types.Action):
      action = action.action
    resp = np.array([int(t) for t in str(action).split()], np.int32)
    t0 = time.perf_counter()
    st = self.inner.step(resp)
    self.walls.append(time.perf_counter() - t0)
    run = self.run
    last = (st.done or self.step_count >= run.max_turns
            or self.ctx + resp.size + st.observation.size + run.max_new > run.max_tokens)
    self.ctx += resp.size + (0 if last else st.observation.size)
    if last and run.check:
      with run.lock:
        run.rec.setdefault(run.key(self.gid, self.pair), {})["walls"] = list(self.walls)
    return base_environment.EnvStepResult(observation=ids_to_text(st.observation),
                                          reward=float(st.reward), done=bool(last), info={})


def check(run) -> dict:
  """Replays every trained episode through a fresh AgenticEnv (same task and episode
  index, no sleeps), its tokens split by the mask into turns (1) and observations (0)."""
  lat = run.task_cfg.latency
  cfg = dataclasses.replace(run.task_cfg, latency=agentic_tasks.ToolLatency(0.0, 0.0, 0.0, 0.0))
  keys = sorted({k for rows in run.step_rows.values() for k in rows})
  bad_r = bad_obs = eos_end = 0
  max_dr, lat_dev, first = 0.0, [], collections.defaultdict(set)
  for k in keys:
    r = run.rec[k]
    task = run.task(r["gid"], r["source"])
    env = agentic_tasks.AgenticEnv(task, r["pair"], cfg)
    toks, mask = np.asarray(r["tokens"], np.int32), np.asarray(r["mask"], np.int32)
    cuts = [0] + [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
    parts = [(mask[a], toks[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]
    turns, obss = [t for m, t in parts if m == 1], [t for m, t in parts if m == 0]
    total, obs_ok = 0.0, True
    for i, t in enumerate(turns):
      eos_end += int(t.size > 0 and t[-1] == tasks.EOS)
      st = env.step(t)
      total += st.reward
      obs_ok &= i >= len(obss) or np.array_equal(obss[i], st.observation)
    first[r["gid"]].add(tuple(turns[0]) if turns else ())
    if r["source"] == "hop":  # the latencies the episode should have slept: the same draws
      rng = np.random.default_rng([*task.latency_seed, r["pair"]])
      lat_dev += [w - lat.draw(rng) for w in r.get("walls", [])]
    dr = abs(total - r["reward"])
    max_dr, bad_r, bad_obs = max(max_dr, dr), bad_r + int(dr > 0), bad_obs + int(not obs_ok)
  return {"episodes": len(keys), "reward_mismatch": bad_r, "max_abs_reward_diff": max_dr,
          "obs_mismatch": bad_obs, "turns_ending_eos": eos_end,
          "distinct_first_turns_per_group": float(np.mean([len(v) for v in first.values()])),
          "tool_wall_minus_latency_s": [min(lat_dev), float(np.median(lat_dev)), max(lat_dev)]
          if lat_dev else None}
