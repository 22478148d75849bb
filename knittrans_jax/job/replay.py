"""Re-trains a finished run's mini-batches, in order, in this process.

The reference for the multi-process trainer: the same trajectories (read from the
run's store), the same mini-batches in the same order, the same plan over the
same number of consumers, but one process holding every consumer's rows, through
the same trainer entry point (job/trainer.py). Loss and parameters should then
match the run's up to floating-point reduction order.
"""
from __future__ import annotations

import dataclasses
import os
import socket

import jax

from knittrans_jax.job.metrics import read_metrics
from knittrans_jax.job.build_trainer import Placement, make_trainer
from knittrans_jax.job.local_trainer import LocalTrainer
from knittrans_jax.job.metrics import MetricsLog
from knittrans_jax.job.setup import JobSetup, check_new_run, make_planner
from knittrans_jax.job.trainer import Trainer
from knittrans_jax.storage import TrajectoryStore
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


@dataclasses.dataclass
class Replay:
  """A replay's result: the trainer (its `state`) and the log (its `records`)."""
  trainer: Trainer
  log: MetricsLog
  workdir: str

  @property
  def quarantine(self):
    return self.trainer.quarantine  # the units and rows the replay could not read


def replay(setup: JobSetup, run_dir: str, workdir: str, consumers: int) -> Replay:
  """Trains `run_dir`'s logged mini-batches in `workdir` (`setup`: the run's, built by
  the caller from its gin config, job_setup(JobConfig())), reading `run_dir`'s store,
  planned over `consumers`."""
  run_dir, workdir = os.path.abspath(run_dir), os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  # One process here, whatever the run's cluster (its weights go to no engine on Ray).
  cfg = dataclasses.replace(setup.cfg, cluster="local")
  dataclasses.replace(cfg, consumers=consumers).consumers_for(1)
  setup = dataclasses.replace(setup, cfg=cfg)
  # The run's store: its JobConfig.store_url (s3://...), else the one in its work dir.
  store = TrajectoryStore.open(cfg.store_url or "file://" + os.path.join(run_dir, "store"))
  if store.schema.retention != "all":
    raise ValueError(f"store {store.url} was written with StoreSchema.retention = "
                     f"{store.schema.retention!r}: its trained rows are reclaimed, so the run "
                     "cannot be replayed; run it with StoreSchema.retention = 'all' (a gin "
                     "binding) to replay it")
  check_new_run(workdir, dataclasses.replace(cfg, store_url=None), resume=False)
  host = socket.gethostname()
  built = make_trainer(setup, workdir, store, Placement(0, 1, consumers, host), resume=False)
  trainers = LocalTrainer(built, workdir, host)
  planner = make_planner(setup, consumers, trainers, store.unit_host)
  trainer = built.trainer
  log = MetricsLog(workdir, cfg.spec)
  try:
    for mb in logged_mini_batches(run_dir, store):
      work = planner(mb)
      v_consume = trainer.version
      sums, grad_norm = trainer.step(work).fetch()
      log.step(mb, [m for grp in mb.groups for m in grp.metas], v_consume, sums, grad_norm,
               admitted_tokens=work.total_tokens, local_fraction=work.local_fraction)
  finally:
    trainer.finish(workdir)
    log.close()
  return Replay(trainer, log, workdir)
