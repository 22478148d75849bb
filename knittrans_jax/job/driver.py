"""The one train loop, over a TrainerHandle and a RolloutPool (job/roles.py).

    driver = Driver(setup, workdir, trainers, store, consumers=C, resume=r, evaluator=e)
    summary = driver.run(open_pool)       # dispatch, poll, admit -> step, until done

One trajectory's journey: a rollout worker generates it and appends it to its
storage unit (rollout/worker.py) and reports metadata; the controller
(job/controller.py) feeds the group to admission (admission/) and plans the admitted
mini-batch (job/work.py, dataplane/); every trainer reads its share from the store,
one micro-batch ahead, and steps (job/trainer.py, train/). Weights go back to the
workers through the work dir (rollout/weights.py).

Each iteration: dispatch, poll, admit -> step; the next mini-batch is admitted and
read while the current one computes; then the step's metrics come back (its one
host sync), its groups retire, weights are published, the held-out evaluation runs
when due and, when due, a checkpoint is written. The same loop runs a local run
(job/local.py) and a Ray run (cluster/ray_job.py).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import signal
import sys
import time
from typing import Callable

from tqdm import tqdm

from knittrans_jax import cpu_profile, gin_cli
from knittrans_jax.cpu_profile import phase
from knittrans_jax.job.controller import Controller, JobStalled
from knittrans_jax.job.evaluation import Evaluator
from knittrans_jax.job.metrics import MetricsLog, StepFlops
from knittrans_jax.job.progress import ControllerState
from knittrans_jax.job.reclaim import WatermarkPublisher
from knittrans_jax.job.roles import RolloutPool, TrainerHandle, TrainerLost
from knittrans_jax.job.setup import JobSetup, make_admission, make_planner
from knittrans_jax.storage import TrajectoryStore, UnitWriter


class Driver:

  def __init__(self, setup: JobSetup, workdir: str, trainers: TrainerHandle,
               store: TrajectoryStore, *, consumers: int, resume: bool,
               evaluator: Evaluator | None, processes: int = 1,
               flops: StepFlops | None = None):
    """`trainers` set up and restored; `processes`: how many trainer processes step
    in collectives (a failure with several leaves no collective checkpoint); `flops`:
    each step's model FLOPs and MFU in metrics.jsonl (build_trainer.step_flops)."""
    self.setup, self.cfg, self.workdir = setup, setup.cfg, workdir
    self.step_seconds: list[float] = []  # per step: launch to fetched, plus publishing
    self.prefix_tokens = setup.suite.prefix_tokens  # the tiny VLM's image positions a row
    self.row_tokens = setup.cfg.seq_len + self.prefix_tokens  # a row's positions, image too
    self.trainers, self.store, self.evaluator, self.processes = trainers, store, evaluator, processes
    # A unit's host as its writer registered it, looked up once per unit.
    self.planner = make_planner(setup, consumers, trainers,
                                functools.lru_cache(maxsize=None)(store.unit_host))
    self.state = (ControllerState.from_json(trainers.progress) if trainers.progress
                  else ControllerState())
    self.policy, self.dispatch = make_admission(setup)
    self.log = MetricsLog(workdir, self.cfg.spec, resume=resume, upto_step=trainers.version,
                          flops=flops)
    self.stop_requested = False
    # Retention: each checkpoint's watermarks go to the store once it is written.
    self.reclaim = WatermarkPublisher(store.retain_from)
    self.held_max = 0  # the most rows the store held right after a publish
    # As t5x does: the operative config right after set-up, so a crashed run has it.
    gin_cli.save_operative_config(workdir)

  def run(self, open_pool: Callable[[], RolloutPool]) -> dict:
    """Trains to JobConfig.train_batches; returns the summary (also summary.json).
    `open_pool()` starts the rollout side; the driver closes it."""
    cfg, trainers = self.cfg, self.trainers
    t0 = time.perf_counter()
    target = cfg.train_batches * cfg.spec.num_mini_batches
    self.bar = tqdm(total=target, initial=min(trainers.version, target), desc=cfg.mode,
                    unit="step", dynamic_ncols=True, mininterval=0.5)

    # Ctrl-C only sets a flag: the loop stops at the next step boundary, so a step is
    # never half recorded (state advanced but its groups not retired).
    def on_sigint(signum, frame):
      self.stop_requested = True
    previous = signal.signal(signal.SIGINT, on_sigint)
    completed, pool, controller = False, None, None
    try:
      pool = open_pool()
      controller = Controller(cfg.spec, self.policy, self.dispatch, pool, self.state,
                              window=cfg.groups_in_flight, synchronous=self.setup.synchronous,
                              stall_timeout_s=cfg.stall_timeout_s)
      controller.resume(self.store.units(),
                        lambda unit, start: self.store.reader(unit).list(start=start))
      if cfg.mode != "colocated":
        trainers.publish()  # the workers' first weights
      self._loop(controller, target)
      if self.stop_requested:
        print("\ninterrupted: saving a checkpoint; resume with --resume")
      completed = True
    finally:
      signal.signal(signal.SIGINT, previous)
      self.bar.close()
      if pool is not None:
        pool.close()
      error = sys.exc_info()[1]
      stalled = isinstance(error, JobStalled)  # raised between steps
      lost = isinstance(error, TrainerLost)  # the deployment may rebuild the trainers
      try:
        if not lost and (completed or stalled or self.processes == 1):
          try:
            if controller is not None:
              self._save(controller, force=True)
          finally:
            trainers.finish()
          self.reclaim.all_durable()  # finish() waited for every checkpoint
          self._reclaim_units()
        else:
          # A failure may have come mid-step, with the others inside a collective: no
          # collective checkpoint now (the last periodic one stands); tell them to stop.
          trainers.abort(repr(error))
      finally:
        self.log.close()
    summary = self.log.summary(wall_s=time.perf_counter() - t0,
                               exposed_data_wait_s=trainers.exposed_wait_s,
                               raw_transfer_s=trainers.raw_transfer_s, mode=cfg.mode,
                               policy=self.policy.name, policy_options=self.policy.options(),
                               groups=dict(self.state.retired),
                               worker_restarts=pool.restarts, dispatch=cfg.dispatch,
                               dispatch_estimates_s={src: self.dispatch.estimate(src)
                                                     for src in self.setup.trained_sources})
    # Retention: what the store holds at the end against the window's worth of rows.
    held = self.store.footprint()
    summary["store"] = {**held, "rows_held_max": max(self.held_max, held["rows_held"]),
                        "retention": self.store.schema.retention,
                        "window_rows": cfg.groups_in_flight * cfg.spec.group_size}
    if self.evaluator is not None:
      summary["eval_train_overlap"] = self.evaluator.train_overlap(range(self.state.next_group))
    if controller is not None:  # which groups trained, by how long they took (issue 60)
      summary["tail_bias"] = controller.tail_bias()
    write_summary(self.workdir, summary)
    if controller is not None:
      fates = controller.fates
      write_trace(self.workdir, self.setup,
                  [{**g, "fate": fates.get(g["group"], "pending")} for g in controller.group_times],
                  self.step_seconds, self.policy.options())
    gin_cli.save_operative_config(self.workdir)
    cpu_profile.write()
    return summary

  def _evaluate(self) -> tuple[dict, float]:
    t = time.perf_counter()
    version = self.trainers.version
    return self.evaluator(self.trainers.eval_params(), version), time.perf_counter() - t

  def _loop(self, ctl: Controller, target: int) -> None:
    trainers = self.trainers
    ahead: collections.deque = collections.deque()  # (mini-batch, work) admitted, being read

    def admit():
      if not ahead and (mb := ctl.admit(trainers.version)) is not None:
        work = self.planner(mb)
        trainers.prefetch(work)  # every trainer starts reading it now
        ahead.append((mb, work))

    ev = self.evaluator
    if ev is not None and ev.config.at_start and trainers.version == 0:
      self.log.start_eval(*self._evaluate())  # the initial policy: where the curve starts
    while trainers.version < target and not self.stop_requested:
      with phase("controller"):
        ctl.dispatch(trainers.version)
        ctl.poll(timeout=0.0 if ahead else 0.05)  # block briefly only with nothing to train
        admit()
      if not ahead:
        ctl.check_stall()
        continue
      mb, work = ahead.popleft()
      v_consume = trainers.version
      t_step = time.perf_counter()
      with phase("train_step"):
        result = trainers.step(work)  # applied on dispatch; the devices compute on
      failure = None
      if trainers.version < target:  # admit and read the next one meanwhile
        try:
          with phase("controller"):
            ctl.dispatch(trainers.version)
            ctl.poll(timeout=0.0)
            admit()
        except Exception as e:  # noqa: BLE001  (re-raised once this step is recorded)
          failure = e
      # Record the step before anything else can fail: its update is applied, so a
      # checkpoint written now must count its groups as trained.
      with phase("train_step"):
        sums, grad_norm = result.fetch()  # the step's one host round trip
      cpu_profile.loop_started()  # (the first step's compilation is start-up)
      train_s = time.perf_counter() - t_step
      with phase("controller"):
        ctl.trained(mb)
      metas = [m for grp in mb.groups for m in grp.metas]
      evaluation, eval_s = None, 0.0
      if ev is not None and ev.due(trainers.version, target):
        evaluation, eval_s = self._evaluate()
      self.log.step(mb, metas, v_consume, sums, grad_norm, admitted_tokens=work.total_tokens,
                    evaluation=evaluation, eval_s=eval_s, local_fraction=work.local_fraction,
                    computed_tokens=work.computed_tokens(self.row_tokens),
                    micro_batches=work.num_micro_batches,
                    prefix_tokens=self.prefix_tokens, train_s=train_s)
      self.bar.update(1)
      self.bar.set_postfix(self.log.postfix(), refresh=False)
      if failure is not None:
        raise failure
      # Weights to the workers after every step (a peer rule may sync less often).
      if self.cfg.mode != "colocated" and trainers.version % self.policy.publish_every == 0:
        t_pub = time.perf_counter()
        with phase("publish"):
          trainers.publish()  # synchronous: before the next train batch is dispatched
        train_s += time.perf_counter() - t_pub
      self.step_seconds.append(train_s)  # the trainer's time for this step, publish included
      if trainers.save_due():
        self._save(ctl)
      if self.reclaim.durable(trainers.durable_step()):
        self.held_max = max(self.held_max, self.store.footprint(files=False)["rows_held"])

  def _reclaim_units(self) -> None:
    """The rollout workers are gone: reclaim up to the last watermarks in their place
    (a unit's writer reclaims between appends, and they made their last), and delete
    the chunk files kept for reuse."""
    if self.store.schema.retention == "all" or not self.reclaim.published:
      return
    for unit in sorted(self.reclaim.published):
      try:
        # Not store.writer: that would register the unit under this host.
        writer = UnitWriter(self.store.url, unit, self.store.schema,
                            host=self.store.unit_host(unit), registered=True)
        writer.reclaim()
        writer.drop_free_pools()  # nothing appends to it again in this run
      except Exception as e:  # noqa: BLE001  (the run's results stand; say what is left)
        print(f"retention: unit {unit!r} not reclaimed at the end ({e}); its writer "
              "reclaims it when the run is resumed")

  def _save(self, ctl: Controller, force: bool = False) -> None:
    progress = ctl.progress()
    if self.trainers.save(progress, force=force):
      self.reclaim.saved(self.trainers.version, progress["watermarks"])


def write_trace(workdir: str, setup: JobSetup, group_times: list[dict],
                step_seconds: list[float], policy_options: dict | None = None) -> None:
  """trace.json: what the simulator's trace mode needs to replay this run
  (sim/trace.py): the run's shape, each finished group's times, each step's time."""
  cfg, spec = setup.cfg, setup.cfg.spec
  trace = {"spec": dataclasses.asdict(spec), "workers": cfg.workers,
           "groups_per_call": cfg.groups_per_call, "engine": cfg.engine, "suite": cfg.suite,
           "mode": cfg.mode, "policy": cfg.policy, "window": cfg.groups_in_flight,
           "policy_options": policy_options,
           "dispatch": cfg.dispatch, "seed": cfg.seed, "groups": group_times,
           "step_seconds": step_seconds}
  with open(os.path.join(workdir, "trace.json"), "w") as f:
    json.dump(trace, f)


def write_summary(workdir: str, summary: dict) -> None:
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
