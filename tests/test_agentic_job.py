"""The job on the agentic workload (configs/agentic_test.gin: multi-turn tool
episodes on each worker's agent loop): every episode trained once as one
trajectory, observations masked, quotas kept, reward rising, and injected
environment faults (raise, hang, malformed) replacing their groups."""
import json
import os

import numpy as np
import pytest

from knittrans_jax.job.metrics import read_metrics
from knittrans_jax.rollout import tasks
from knittrans_jax.sim import simulate
from knittrans_jax.sim.trace import Trace, steady_state
from knittrans_jax.storage import TrajectoryStore
from test_job import KEEP_ROWS, finish, start

pytestmark = pytest.mark.slow


# 25 train batches of 2 mini-batches: enough steps for the reward to rise by far more
# than a schedule moves it (below).
TRAIN_BATCHES = 25
STEPS = 2 * TRAIN_BATCHES


def test_agentic_job_trains_episodes_and_replaces_failed_groups(tmp_path):
  work = tmp_path / "run"
  out = finish(start(work, f"JobConfig.train_batches = {TRAIN_BATCHES}",
                     "AgenticTaskConfig.fault_rate = 0.03",
                     "AgentConfig.step_timeout_s = 1.0", "AgenticTaskConfig.hang_s = 2.0",
                     "OptimizerConfig.learning_rate = 3e-2", KEEP_ROWS,
                     gin_file="configs/agentic_test.gin"))
  summary = json.load(open(os.path.join(work, "summary.json")))
  recs = read_metrics(str(work))
  ids = [i for r in recs for i in r["ids"]]
  assert summary["steps"] == len(recs) == STEPS
  assert len(ids) == len(set(ids)) == summary["trajectories"] == STEPS * 16, "trained twice"
  assert summary["quota_violations"] == 0
  # Faults failed some groups; each was replaced (the controller's 'failed'), named
  # in the log with its environment and step.
  assert summary["groups"].get("failed", 0) > 0, summary["groups"]
  assert "environment 'agentic', step" in out
  store = TrajectoryStore.open("file://" + os.path.join(os.path.abspath(work), "store"))
  metas = {m.id: m for m in store.list_committed()}
  assert set(ids) <= set(metas)
  # Every episode is one row: each untrained run of its response is exactly one
  # observation (RESULT v SEP), between turns that are trained.
  hop = [metas[i] for i in ids if metas[i].source == "hop"]
  payload = store.read(hop[:64]).result()
  turns = []
  for m, tok, mask in zip(payload.metas, payload.tokens, payload.loss_mask):
    resp, rmask = tok[m.prompt_len:], mask[m.prompt_len:].astype(bool)
    assert rmask[0] and rmask[-1] and m.loss_tokens == int(rmask.sum())
    edges = np.flatnonzero(np.diff(rmask.astype(int)))  # where a masked run starts / ends
    starts, ends = edges[0::2] + 1, edges[1::2] + 1
    for a, b in zip(starts, ends):
      assert resp[a] == tasks.RESULT and resp[b - 1] == tasks.SEP and b - a == 3
    turns.append(len(starts) + 1)
    # The stored turns are exactly the trained runs, each with its versions and time.
    trained = np.flatnonzero(np.diff(np.concatenate([[0], rmask.astype(int), [0]])))
    assert [(t.start, t.end) for t in m.turns] == list(zip(trained[0::2], trained[1::2]))
    assert m.turns[0].version_first == m.version_first
    assert max(t.version_last for t in m.turns) == m.version_last
    assert m.gen_seconds > 0 and m.env_seconds > 0
  assert max(turns) > 1  # multi-turn episodes were trained
  assert summary["turns_per_episode"] == pytest.approx(np.mean([
      len(metas[i].turns) for i in ids]), rel=1e-6)
  # Each turn's architectural staleness, from its own first version, is in the step's record.
  turn_arch = []
  for r in recs:
    expect = [r["step"] - 1 - t.version_first - r["index"] for i in r["ids"]
              for t in metas[i].turns]
    assert r["turn_arch"] == expect
    turn_arch += expect
  assert summary["turn_arch_staleness_mean"] == pytest.approx(np.maximum(turn_arch, 0).mean())
  assert summary["episode_env_s_mean"] > 0 and summary["episode_gen_s_mean"] > 0
  # Packed (agentic_tails.gin): several episodes a row, less padding computed than a
  # row of seq_len = 80 per episode (0.65 against 0.82 when written: a mini-batch of 16
  # short episodes half fills the 8 rows one micro-batch has on 8 devices).
  padded = 1 - np.mean([sum(metas[i].length for i in r["ids"]) / (80 * len(r["ids"]))
                        for r in recs])
  assert summary["padding_fraction"] < padded - 0.1, (summary["padding_fraction"], padded)
  # Padded, a step is 2 micro-batches of 8 rows (16 episodes). Packed, most steps fit one;
  # a step whose long-tailed episodes overflow a consumer's row of 80 takes two (1 in 50
  # steps of a clean-clone suite, 2026-12-07, failed an earlier "always one" check).
  for r in recs:
    filled = sum(metas[i].length for i in r["ids"])
    assert -(-filled // (8 * 80)) <= r["micro_batches"] <= 2, (filled, r["micro_batches"])
    assert r["padding_fraction"] == pytest.approx(1 - filled / (r["micro_batches"] * 8 * 80))
  assert np.mean([r["micro_batches"] for r in recs]) < 1.5
  # The engine's log-probs over whole episodes agree with the trainer's.
  assert summary["logprob_abs_diff_max"] < 1e-4
  # The reward rises: the second half of the steps against the first. A step's mean
  # reward scatters by 0.03-0.05 about the run's trend, and the trend itself moves with
  # the schedule the machine's load gives this asynchronous job. At 30 steps and a
  # learning rate of 5e-2 the check failed in 2 of 8 clean-clone suites (2026-12-06/07;
  # halves 0.071 -> 0.066 in the second). Beside a load of XLA tests, 2026-12-07, the
  # halves gained 0.021-0.049 at 30 steps (6 runs, 5e-2 and 3e-2), and at 50 steps 0.055
  # and 0.057 at 5e-2, 0.075 and 0.087 at 3e-2 (docs/results/2026-12-07-tests.md).
  rewards = [r["reward"] for r in recs]
  assert np.mean(rewards[STEPS // 2:]) > np.mean(rewards[:STEPS // 2]), rewards
  # trace.json: each finished group's generation time and each step's time, which the
  # simulator replays (sim/trace.py) at the run's configuration.
  raw = json.load(open(os.path.join(work, "trace.json")))
  assert len(raw["step_seconds"]) == STEPS and all(t > 0 for t in raw["step_seconds"])
  assert {g["group"] for g in raw["groups"]} >= {metas[i].group_id for i in ids}
  trace = Trace.from_run(str(work))
  assert set(trace.group_seconds) == {"hop", "nearest"} and trace.concurrent_groups is None
  sim = steady_state(simulate(trace.sim_config(TRAIN_BATCHES), raw["policy"], window=raw["window"],
                              dispatch=raw["dispatch"]), trace.spec, skip_steps=2)
  assert sim["traj_per_s"] > 0 and sim["quota_violations"] == 0
