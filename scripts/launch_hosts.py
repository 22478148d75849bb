"""A job across hosts on one machine: each role on its own network namespace
(knittrans_jax/testing/netns.py), joined by a switch, reaching the others only by
their addresses, as on a cluster.

  sudo python scripts/launch_hosts.py --workdir runs/hosts --overwrite -- \
      --gin_file configs/text_grpo_test.gin

Hosts: `store` (the S3 server, with --store s3), `trainer0..` (the trainer
processes under jax.distributed, process 0 on trainer0 also running the
controller), `rollout0..` (remote rollout workers, scripts/rollout_worker.py).
Everything after `--` goes to scripts/train.py on every trainer host. The work dir
is shared (the namespaces share the file system, as NFS would). With --store s3
the store is s3://knittrans/WORKDIR_NAME on the store host's S3 server, reached by
its address (AWS_ENDPOINT_URL_S3 in every process's environment); afterwards
WORKDIR/logs/store_listing.json lists what it holds (committed trajectory ids, each
unit's host), as a trainer host reads it.

Faults, for the test (tests/test_netns_hosts.py) and for measuring:
  --link_down_at K     after step K, unplug the last rollout host; prints how long
                       the controller took to release its worker
  --kill_trainers_at K once the checkpoint of step K (or a later one) is written,
                       SIGKILL every process on the trainer hosts, then start them
                       again with --resume (and fresh workers; an unplugged rollout
                       host is plugged in again first)
Prints a JSON report (wall time, release time, ...) and writes it to --json.
Needs root (network namespaces); says so and exits 2 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_local import ROOT, child_env, tail  # noqa: E402

from knittrans_jax.faults.trainer_kill import _latest_checkpoint, _records  # noqa: E402
from knittrans_jax.testing import netns  # noqa: E402
from knittrans_jax.testing.s3_server import start_s3_server  # noqa: E402

COORDINATOR_PORT = 8476  # each start gets the next one: a killed run's port may linger
RELEASED = "re-dispatching what it held"
BUCKET = "knittrans"
# Run on a host (the store may be reachable only from the hosts): every committed
# trajectory id in the store and the host each unit's writer named.
LIST_STORE = ("import json, sys; from knittrans_jax.storage import TrajectoryStore; "
              "s = TrajectoryStore.open(sys.argv[1]); "
              "print(json.dumps({'committed': [m.id for m in s.list_committed()], "
              "'unit_hosts': {u: s.unit_host(u) for u in s.units()}}))")


class HostsJob:
  """The job's processes on the test hosts; `start` runs (or resumes) them."""

  def __init__(self, hosts: netns.TestHosts, workdir: str, train_args: list[str], trainers: int,
               rollouts: int, devices_per_process: int, store_url: str | None,
               store_env: dict | None = None, remote_timeout_s: float = 15.0):
    self.hosts, self.workdir, self.train_args = hosts, workdir, train_args
    self.trainer_hosts = [f"trainer{p}" for p in range(trainers)]
    self.rollout_hosts = [f"rollout{r}" for r in range(rollouts)]
    self.devices, self.store_url, self.store_env = devices_per_process, store_url, store_env or {}
    self.remote_timeout_s = remote_timeout_s
    self.trainers: list[subprocess.Popen] = []
    self.workers: list[subprocess.Popen] = []
    self.starts = 0
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)

  def log_path(self, host: str) -> str:
    return os.path.join(self.workdir, "logs", f"host_{host}.log")

  def _run(self, host: str, argv: list[str], devices: int) -> subprocess.Popen:
    env = {**child_env(devices), **self.store_env, "PYTHONUNBUFFERED": "1"}
    out = open(self.log_path(host), "a")  # a resumed run appends
    try:
      return self.hosts.run(host, argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    finally:
      out.close()

  def start(self, resume: bool = False) -> None:
    head = self.hosts.address(self.trainer_hosts[0])
    coordinator = f"{head}:{COORDINATOR_PORT + self.starts}"
    self.starts += 1
    bindings = ["JobConfig.workers = 0",  # every rollout comes from the rollout hosts
                "JobConfig.control_address = '0.0.0.0:0'",
                f"JobConfig.control_advertise = '{head}'",
                f"JobConfig.remote_timeout_s = {self.remote_timeout_s}"]
    if self.store_url:
      bindings.append(f"JobConfig.store_url = '{self.store_url}'")
    args = [*self.train_args, "--workdir", self.workdir]
    for b in bindings:
      args += ["--gin_bindings", b]
    if resume:
      args.append("--resume")
    self.trainers = []
    for p, host in enumerate(self.trainer_hosts):
      argv = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *args]
      if len(self.trainer_hosts) > 1:
        argv += ["--coordinator_address", coordinator, "--num_processes",
                 str(len(self.trainer_hosts)), "--process_id", str(p),
                 "--host_address", self.hosts.address(host)]
      self.trainers.append(self._run(host, argv, self.devices))
    # The workers wait for the controller's control.json (and for its server, on a resume).
    self.workers = [self._run(host, [sys.executable, os.path.join(ROOT, "scripts", "rollout_worker.py"),
                                     "--workdir", self.workdir, "--name", host], 1)
                    for host in self.rollout_hosts]

  def failed(self) -> str | None:
    for host, p in zip(self.trainer_hosts, self.trainers):
      if p.poll() not in (None, 0):
        return (f"{host}: exit code {p.returncode}\n--- {self.log_path(host)} (tail) ---\n"
                f"{tail(self.log_path(host))}")
    return None

  def finished(self) -> bool:
    return all(p.poll() == 0 for p in self.trainers)

  def kill_trainers(self) -> None:
    for host in self.trainer_hosts:
      self.hosts.kill_host(host)
    for p in self.trainers:
      p.wait()

  def wait_workers(self, timeout_s: float) -> None:
    """Workers leave when their job ends (or is gone); one that cannot hear it (its
    host unplugged) is killed with its host."""
    deadline = time.monotonic() + timeout_s
    for host, p in zip(self.rollout_hosts, self.workers):
      try:
        p.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        self.hosts.kill_host(host)
        p.wait()


def released(log_path: str) -> bool:
  with open(log_path, errors="replace") as f:
    return RELEASED in f.read()


def run(workdir: str, train_args: list[str], trainers: int = 2, rollouts: int = 2,
        devices_per_process: int = 4, store: str = "file", link_down_at: int | None = None,
        kill_trainers_at: int | None = None, remote_timeout_s: float = 15.0,
        timeout_s: float = 900.0, poll_s: float = 0.1) -> dict:
  """Runs the job across the test hosts to the end; returns the report."""
  names = ["store", *(f"trainer{p}" for p in range(trainers)),
           *(f"rollout{r}" for r in range(rollouts))]
  if store not in ("file", "s3"):
    raise ValueError(f"--store = {store!r}: use 'file' or 's3'")
  report: dict = {"hosts": {}, "steps": 0, "store": store}
  t0 = time.monotonic()
  with netns.TestHosts(names) as hosts, contextlib.ExitStack() as stack:
    report["hosts"] = {h: hosts.address(h) for h in names}
    store_url, store_env = None, {}  # None: file://WORKDIR/store, the job's default
    if store == "s3":
      s3 = stack.enter_context(start_s3_server(hosts.address("store"), netns=hosts.ns("store")))
      s3.create_bucket(BUCKET)
      store_url, store_env = f"s3://{BUCKET}/{os.path.basename(workdir)}", s3.env
      report["store_url"], report["s3_endpoint"] = store_url, s3.endpoint
    job = HostsJob(hosts, workdir, train_args, trainers, rollouts, devices_per_process,
                   store_url, store_env, remote_timeout_s)
    job.start()
    cut, down = job.rollout_hosts[-1], False
    t_down = t_kill = None
    deadline = t0 + timeout_s
    while not job.finished():
      if (why := job.failed()) is not None:
        raise RuntimeError(f"a trainer host failed: {why}")
      now = time.monotonic()
      steps = len(_records(workdir))
      if now > deadline:
        raise TimeoutError(f"the job did not finish in {timeout_s:.0f} s ({steps} steps)")
      if steps and "first_step_s" not in report:
        report["first_step_s"] = round(now - t0, 1)
      if link_down_at is not None and t_down is None and steps >= link_down_at:
        hosts.link_down(cut)
        t_down, down = now, True
        report["link_down"] = {"host": cut, "after_step": steps, "at_s": round(now - t0, 2)}
      if t_down is not None and "release_s" not in report["link_down"] and released(
          job.log_path(job.trainer_hosts[0])):
        report["link_down"]["release_s"] = round(now - t_down, 2)
      if (kill_trainers_at is not None and t_kill is None
          and _latest_checkpoint(workdir) >= kill_trainers_at):
        job.kill_trainers()
        t_kill = time.monotonic()
        shutil.copy(os.path.join(workdir, "metrics.jsonl"),
                    os.path.join(workdir, "logs", "metrics_at_kill.jsonl"))
        report["kill"] = {"hosts": job.trainer_hosts, "after_step": len(_records(workdir)),
                          "checkpoint_step": _latest_checkpoint(workdir),
                          "at_s": round(t_kill - t0, 2)}
        if down:  # the unplugged host comes back, its stuck worker replaced by a fresh one
          hosts.link_up(cut)
          hosts.kill_host(cut)
          down = False
        job.wait_workers(timeout_s=30)  # they hear the job is gone and leave
        report["kill"]["workers_left_s"] = round(time.monotonic() - t_kill, 2)
        job.start(resume=True)
      time.sleep(poll_s)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    if t_kill is not None:
      report["kill"]["resumed_to_end_s"] = round(time.monotonic() - t_kill, 1)
    report["steps"] = len(_records(workdir))
    if down:  # its worker cannot hear that the job ended
      hosts.kill_host(cut)
    job.wait_workers(timeout_s=30)
    # What the store holds, listed from a trainer host, for checks after the run.
    url = store_url or "file://" + os.path.join(workdir, "store")
    listing = job.hosts.run(job.trainer_hosts[0], [sys.executable, "-c", LIST_STORE, url],
                            env={**os.environ, **store_env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    out, err = listing.communicate(timeout=120)
    if listing.returncode:
      raise RuntimeError(f"listing the store {url} failed: {err[-2000:]}")
    with open(os.path.join(workdir, "logs", "store_listing.json"), "w") as f:
      f.write(out)
  return report


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", default="runs/hosts")
  parser.add_argument("--overwrite", action="store_true", help="delete WORKDIR first")
  parser.add_argument("--trainers", type=int, default=2, help="trainer hosts (one process each)")
  parser.add_argument("--rollouts", type=int, default=2, help="rollout hosts (one worker each)")
  parser.add_argument("--devices_per_process", type=int, default=4)
  parser.add_argument("--store", default="file",
                      help="'file': WORKDIR/store; 's3': an S3 server (moto) on host `store`")
  parser.add_argument("--link_down_at", type=int, default=None)
  parser.add_argument("--kill_trainers_at", type=int, default=None)
  parser.add_argument("--remote_timeout_s", type=float, default=15.0,
                      help="JobConfig.remote_timeout_s: silence before a worker is released")
  parser.add_argument("--timeout_s", type=float, default=900.0)
  parser.add_argument("--json", default=None, help="also write the report here")
  args, train_args = parser.parse_known_args()
  if train_args and train_args[0] == "--":
    train_args = train_args[1:]
  # SIGTERM ends the run as Ctrl-C does: the hosts and their processes are removed.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  ok, why = netns.available()
  if not ok:
    print(f"launch_hosts: {why}", file=sys.stderr)
    sys.exit(2)
  if args.overwrite:
    shutil.rmtree(args.workdir, ignore_errors=True)
  workdir = os.path.abspath(args.workdir)
  report = run(workdir, train_args, args.trainers, args.rollouts, args.devices_per_process,
               args.store, args.link_down_at, args.kill_trainers_at, args.remote_timeout_s,
               args.timeout_s)
  print(json.dumps(report, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
