"""Per-step metrics of the job: metrics.jsonl, staleness records, the final summary.

`MetricsLog` writes a run's metrics.jsonl, one JSON record per optimizer step;
`read_metrics` is the one reader of it (the studies, figures, benchmarks, replay and
fault checks all read through it).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import time

import numpy as np

from knittrans_jax.admission import TrainBatchSpec
from knittrans_jax.admission.costs import quota_error
from knittrans_jax.job.tb_events import ScalarWriter
from knittrans_jax.models.flops import mfu_fields, train_flops


METRICS_FILE = "metrics.jsonl"


def read_metrics(workdir_or_path: str, partial: bool = False) -> list[dict]:
  """The step records of a run's metrics.jsonl (its work dir, or the file itself), in
  step order: one per optimizer step as `MetricsLog.step` wrote it, with an `eval`
  entry on the steps that ran the held-out evaluation (the initial policy's is in
  eval_start.json). Blank lines are skipped; a line that is not JSON is a ValueError
  naming the file and the line.

  partial: the run may still be writing, or was killed: a missing file reads as no
  records and a last line that is not JSON (torn mid-write) is left out."""
  path = workdir_or_path
  if not path.endswith(".jsonl"):
    path = os.path.join(path, METRICS_FILE)
  if partial and not os.path.exists(path):
    return []
  with open(path) as f:
    lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
  records = []
  for k, (n, line) in enumerate(lines):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if partial and k == len(lines) - 1:  # only the last line can be torn
        break
      raise ValueError(f"{path} line {n} is not JSON ({e.msg}): {line.strip()[:80]!r}") from None
  return records


def engine_vs_trainer(sums: dict) -> dict:
  """The rollout engine's behaviour log-probs against the trainer's, from a step's sums
  (rl/losses.py): |difference| mean and max on tokens at version lag 0 (None when the
  step had none), and the importance ratio's mean and standard deviation."""
  tokens = max(float(sums.get("tokens", 0.0)), 1.0)
  out = {"ratio_mean": None, "ratio_std": None}  # no ratio: the nll objective
  if "ratio" in sums:
    mean = float(sums["ratio"]) / tokens
    var = float(sums["ratio_dev_sq"]) / tokens - (mean - 1.0) ** 2
    out.update(ratio_mean=mean, ratio_std=float(np.sqrt(max(var, 0.0))))
  fresh = float(sums.get("fresh_tokens", 0.0))
  out["lag0_tokens"] = int(round(fresh))
  out["logprob_abs_diff_mean"] = float(sums["fresh_logp_abs_diff"]) / fresh if fresh else None
  out["logprob_abs_diff_max"] = float(sums["max_fresh_logp_abs_diff"]) if fresh else None
  if "corrected" in sums:
    out["corrected_frac"] = float(sums["corrected"]) / tokens
  return out


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """What a step's model FLOPs and MFU need (models/flops.py): the decoder's config
  and matmul parameters, one device's peak FLOP/s (value None: no MFU) and the
  trainers' device count."""
  model: object  # DecoderConfig
  n_matmul: int
  peak: dict
  devices: int

  def fields(self, lengths, seconds: float) -> dict:
    """model_flops of the step's trajectories; model_flops_per_s over `seconds` (the
    step as the driver sees it: launch to its fetched sums); mfu where the peak is
    known."""
    flops = train_flops(self.model, self.n_matmul, lengths)
    out = {"model_flops": flops, "model_flops_per_s": flops / seconds}
    if self.peak["value"] is not None:
      out["mfu"] = mfu_fields(flops, seconds, self.peak, self.devices)["mfu"]
    return out


class MetricsLog:

  def __init__(self, workdir: str, spec: TrainBatchSpec, resume: bool = False,
               upto_step: int = 0, flops: StepFlops | None = None):
    """`flops`: each step's model FLOPs (and MFU) in its record; None: not counted
    (a model the formula does not cover)."""
    self.spec, self.flops = spec, flops
    self.path = os.path.join(workdir, METRICS_FILE)
    self.records: list[dict] = []
    if resume:  # a killed run's last line may be torn; steps after the checkpoint are undone
      self.records = [r for r in read_metrics(self.path, partial=True) if r["step"] <= upto_step]
    with open(self.path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in self.records)
    self.arch: list[int] = [a for r in self.records for a in r.get("arch", [])]
    self.turn_arch: list[int] = [a for r in self.records for a in r.get("turn_arch", [])]
    self.batch_counts = collections.defaultdict(collections.Counter)
    for r in self.records:
      self.batch_counts[r["train_batch"]].update(r["source_counts"])
    self.t0 = time.perf_counter()
    self.trajectories = sum(r["trajectories"] for r in self.records)
    self.eval_s = 0.0  # wall time spent in held-out evaluation (this process)
    self.start_path = os.path.join(workdir, "eval_start.json")
    self.eval_start = None
    if resume and os.path.exists(self.start_path):
      with open(self.start_path) as f:
        self.eval_start = json.load(f)
    self.tb = ScalarWriter(os.path.join(workdir, "tensorboard"))

  def start_eval(self, evaluation: dict, eval_s: float) -> None:
    """The held-out evaluation of the initial policy (step 0), in eval_start.json."""
    self.eval_s += eval_s
    self.eval_start = evaluation
    with open(self.start_path, "w") as f:
      json.dump(evaluation, f)
    for name, r in evaluation.items():
      self.tb.add_scalar(f"eval/{name}", r, 0)

  def step(self, mb, metas, v_consume: int, sums: dict, grad_norm: float,
           admitted_tokens: int | None = None, evaluation: dict | None = None,
           eval_s: float = 0.0, local_fraction: float | None = None,
           computed_tokens: int | None = None, micro_batches: int | None = None,
           prefix_tokens: int = 0, train_s: float | None = None) -> None:
    """eval_s: the seconds `evaluation` took; time_s - eval_s is training wall time.
    local_fraction: the step's rows planned onto a consumer on their unit's host.
    computed_tokens: the token positions the step computed on (padding included):
    its padding_fraction is the share of them no trajectory filled (a trajectory fills
    its tokens and `prefix_tokens` image positions, the tiny VLM's)."""
    self.eval_s += eval_s
    arch = [v_consume - m.version_first - mb.index for m in metas]
    self.arch += arch
    episodes = [m for m in metas if m.turns]
    tokens = max(sums.get("tokens", 0.0), 1.0)
    counts = collections.Counter(grp.source for grp in mb.groups)
    self.batch_counts[mb.train_batch].update(counts)
    self.trajectories += len(metas)
    rec = {
        "step": v_consume + 1, "train_batch": mb.train_batch, "index": mb.index,
        "reward": float(np.mean([m.reward for m in metas])),
        "reward_by_source": {s: float(np.mean([m.reward for m in metas if m.source == s]))
                             for s in counts},
        "loss": sums.get("loss", 0.0) / tokens, "entropy": sums.get("entropy", 0.0) / tokens,
        "clip_frac": sums.get("clip_frac", 0.0) / tokens, "grad_norm": grad_norm,
        **({"kl": sums["kl"] / tokens} if "kl" in sums else {}),  # k3, against the reference
        **engine_vs_trainer(sums),
        "arch_staleness_mean": float(np.mean(np.maximum(arch, 0))),
        "trajectories": len(metas), "source_counts": dict(counts), "arch": arch,
        **({"eval": evaluation} if evaluation else {}),
        "ids": [m.id for m in metas], "groups": [grp.group_id for grp in mb.groups],  # admission order
        "response_len": float(np.mean([m.response_len for m in metas])),
        # Loss tokens admitted but not trained (rows of a quarantined unit), all processes.
        "tokens_skipped": (int(round(admitted_tokens - sums.get("tokens", 0.0)))
                           if admitted_tokens is not None else 0),
        "local_fraction": local_fraction,
        "time_s": time.perf_counter() - self.t0, "eval_s": self.eval_s,
    }
    if train_s is not None:  # the step's launch to its fetched sums (the driver's view)
      rec["train_s"] = train_s
      if self.flops is not None and train_s > 0:
        rec.update(self.flops.fields([m.length for m in metas], train_s))
    if computed_tokens:
      rec.update(micro_batches=micro_batches, padding_fraction=1.0 - sum(
          m.length + prefix_tokens for m in metas) / computed_tokens)
    if episodes:  # agent episodes: turns, their own staleness, where the time went
      turn_arch = [v_consume - t.version_first - mb.index for m in episodes for t in m.turns]
      self.turn_arch += turn_arch
      rec.update(episodes=len(episodes), turns=float(np.mean([len(m.turns) for m in episodes])),
                 turn_arch=turn_arch,
                 gen_s=float(np.mean([m.gen_seconds for m in episodes])),
                 env_s=float(np.mean([m.env_seconds for m in episodes])))
    self.records.append(rec)
    with open(self.path, "a") as f:
      f.write(json.dumps(rec) + "\n")
    for key in ("reward", "loss", "entropy", "clip_frac", "grad_norm", "arch_staleness_mean",
                "response_len"):
      self.tb.add_scalar(f"train/{key}", rec[key], rec["step"])
    for source, r in rec["reward_by_source"].items():
      self.tb.add_scalar(f"reward/{source}", r, rec["step"])
    for name, r in (evaluation or {}).items():
      self.tb.add_scalar(f"eval/{name}", r, rec["step"])

  def postfix(self) -> dict:
    r = self.records[-1]
    el = max(r["time_s"], 1e-9)
    return {"reward": f"{r['reward']:.3f}", "stale": f"{r['arch_staleness_mean']:.2f}",
            "traj/s": f"{self.trajectories / el:.1f}"}

  def quota_violations(self) -> int:
    return self.spec.quota_violations(self.batch_counts)

  def close(self) -> None:
    self.tb.close()

  def _episodes(self) -> dict:
    """Agent episodes over the run (empty when it had none): turns per episode, the
    seconds an episode spent generating and in its environment, and the
    architectural staleness of each turn (v_consume - the turn's first version - j),
    lower than its episode's where later turns ran on fresher weights."""
    recs = [r for r in self.records if "turns" in r]
    if not recs:
      return {}
    w = np.asarray([r["episodes"] for r in recs], float)  # per-step means, weighted
    mean = lambda key: float(np.average([r[key] for r in recs], weights=w))
    return {"turns_per_episode": mean("turns"), "episode_gen_s_mean": mean("gen_s"),
            "episode_env_s_mean": mean("env_s"),
            "turn_arch_staleness_mean": float(np.mean(np.maximum(self.turn_arch, 0)))}

  def summary(self, **extra) -> dict:
    steps = len(self.records)
    tenth = max(1, steps // 10)
    rewards = [r["reward"] for r in self.records]
    arch = np.maximum(np.asarray(self.arch or [0]), 0)
    evals = [r["eval"] for r in self.records if r.get("eval")]
    lag0 = [r for r in self.records if r.get("logprob_abs_diff_max") is not None]
    n0 = sum(r["lag0_tokens"] for r in lag0)
    return {
        # eval_start: the initial policy's; eval_first: after the first evaluated step.
        "eval_start": self.eval_start,
        "eval_first": evals[0] if evals else None, "eval_last": evals[-1] if evals else None,
        "reward_first": float(np.mean(rewards[:tenth])) if rewards else None,
        "reward_last": float(np.mean(rewards[-tenth:])) if rewards else None,
        "arch_staleness_mean": float(arch.mean()),
        "arch_staleness_signed_mean": float(np.mean(self.arch or [0])),
        "arch_staleness_p99": float(np.percentile(arch, 99)),
        "quota_violations": self.quota_violations(), "steps": steps,
        "quota_error": quota_error(((r["train_batch"], 0, r["source_counts"])
                                    for r in self.records), self.spec),
        "tokens_skipped": sum(r.get("tokens_skipped", 0) for r in self.records),
        "trajectories": self.trajectories, "eval_s": self.eval_s,
        "padding_fraction": (float(np.mean(pad)) if (pad := [
            r["padding_fraction"] for r in self.records if "padding_fraction" in r]) else None),
        "local_fraction": (float(np.mean(local)) if (local := [
            r["local_fraction"] for r in self.records if r.get("local_fraction") is not None])
            else None),
        # The engine's log-probs against the trainer's at version lag 0, over the run.
        "logprob_abs_diff_mean": (sum(r["logprob_abs_diff_mean"] * r["lag0_tokens"] for r in lag0)
                                  / n0 if n0 else None),
        "logprob_abs_diff_max": max((r["logprob_abs_diff_max"] for r in lag0), default=None),
        **self._episodes(),
        **extra,
    }
