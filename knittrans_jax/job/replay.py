"""Re-trains a finished run's mini-batches, in order, in this process.

The reference for the multi-process trainer: the same trajectories (read from the
run's store), the same mini-batches in the same order, the same plan over the
same number of consumers, but one process holding every consumer's rows, through
the same trainer entry point (job/trainer.py). Loss and parameters should then
match the run's up to floating-point reduction order.
"""
from __future__ import annotations

import os

import jax

from knittrans_jax.job.config import JobConfig
from knittrans_jax.job.metrics import read_metrics
from knittrans_jax.job.run import Job
from knittrans_jax.train import Checkpointer, abstract_state
from knittrans_jax.types import GroupInfo, MiniBatch


def logged_mini_batches(run_dir: str, store) -> list[MiniBatch]:
  """The run's mini-batches as metrics.jsonl recorded them, metadata from its store."""
  records = read_metrics(run_dir)
  by_group: dict[int, list] = {}
  for unit in store.units():
    for m in store.list_committed(unit):
      by_group.setdefault(m.group_id, []).append(m)
  out = []
  for r in records:
    groups = []
    for gid in r["groups"]:
      if gid not in by_group:
        raise ValueError(f"{run_dir}: step {r['step']} trained group {gid}, which its store "
                         "does not hold")
      groups.append(GroupInfo.from_metas(sorted(by_group[gid], key=lambda m: m.index_in_group)))
    out.append(MiniBatch(train_batch=r["train_batch"], index=r["index"], groups=tuple(groups),
                         admitted_version=r["step"] - 1))
  return out


def run_state(run_dir: str, like):
  """The run's last checkpointed TrainState, sharded like the TrainState `like`."""
  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
  try:
    state, _ = ckpt.restore(abstract_state(like, jax.tree.map(lambda x: x.sharding, like)))
  finally:
    ckpt.close()
  return state


def replay(run_dir: str, workdir: str, consumers: int) -> Job:
  """Builds a Job in `workdir` (the gin config already parsed, as for the run) that
  reads `run_dir`'s store, trains its logged mini-batches planned over `consumers`,
  and returns it (job.trainer.state, job.log.records)."""
  run_dir = os.path.abspath(run_dir)
  # The run's store: its JobConfig.store_url (s3://...), else the one in its work dir.
  store_url = JobConfig().store_url or "file://" + os.path.join(run_dir, "store")
  job = Job(workdir, store_url=store_url, consumers=consumers)
  try:
    for mb in logged_mini_batches(run_dir, job.store):
      work = job.planner(mb)
      v_consume = job.trainer.version
      sums, grad_norm = job.trainer.step(work).fetch()
      job.log.step(mb, [m for grp in mb.groups for m in grp.metas], v_consume, sums, grad_norm,
                   admitted_tokens=work.total_tokens, local_fraction=work.local_fraction)
  finally:
    job.trainer.finish(job.workdir)
    job.log.close()
  return job
