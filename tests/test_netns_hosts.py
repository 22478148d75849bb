"""The job across real hosts on one machine: each role on its own network namespace
(knittrans_jax/testing/netns.py; scripts/launch_hosts.py runs the job).

One run of 6 steps shows the three things (one run: the file's time budget holds
one job's start-up, not three): 2 trainer hosts under jax.distributed, 2 rollout
hosts, the store on the store host's S3 server (moto, testing/s3_server.py).
- rollout1 is unplugged after step 1: the controller releases its worker after
  JobConfig.remote_timeout_s and dispatches the groups it held again (b);
- once the step-4 checkpoint is written, every process on both trainer hosts is
  SIGKILLed; they start again with --resume (rollout1 plugged in again) (c);
- the job completes with every trajectory trained once (a).
Skipped, with the reason, without root or network namespaces.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from knittrans_jax.testing import netns

OK, WHY = netns.available()
needs_hosts = pytest.mark.skipif(not OK, reason=f"no test hosts here: {WHY}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6  # configs/text_grpo_test.gin, 3 train batches of 2 mini-batches
ROWS = 16  # trajectories a step trains (g = 4 groups x n = 4)
TIMEOUT_S = 6.0  # JobConfig.remote_timeout_s (heartbeat every 2 s)


def launch(workdir, flags, bindings=()):
  # One group per sampler call: a worker holds queued groups it has not started.
  bindings = ["JobConfig.train_batches = 3", "JobConfig.groups_per_call = 1", *bindings]
  cmd = [sys.executable, "scripts/launch_hosts.py", "--workdir", str(workdir),
         "--json", str(workdir) + ".json", "--timeout_s", "400", "--store", "s3", *flags, "--",
         "--gin_file", "configs/text_grpo_test.gin"]
  for b in bindings:
    cmd += ["--gin_bindings", b]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  with open(str(workdir) + ".json") as f:
    return json.load(f)


def records(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def controller_log(workdir):
  with open(workdir / "logs" / "host_trainer0.log", errors="replace") as f:
    return f.read()


def joined(log):
  """worker id -> the rollout host it joined from."""
  return {int(w): host for w, host in re.findall(r"remote rollout worker (\d+) joined from (\w+)", log)}


def store_listing(workdir):
  return json.loads((workdir / "logs" / "store_listing.json").read_text())


def trained_once(workdir):
  """Every step recorded, each trajectory in it once, and only committed ones."""
  recs = records(workdir / "metrics.jsonl")
  ids = [i for r in recs for i in r["ids"]]
  assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
  assert len(ids) == len(set(ids)) == STEPS * ROWS, "a trajectory trained twice, or missing"
  # The store is on the store host's S3 server, reachable only from the hosts: the
  # script lists it from trainer0 after the run.
  committed = set(store_listing(workdir)["committed"])
  assert set(ids) <= committed, "trained something that was never committed"
  return recs, ids


def test_available_says_why_not(monkeypatch):
  """Without root or `ip` the hosts tests skip with this reason, never pass."""
  monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
  assert netns.available() == (False, "network namespaces need root (euid is 1000)")
  monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
  monkeypatch.setattr(netns.shutil, "which", lambda name: None)
  ok, why = netns.available()
  assert not ok and "no `ip` binary" in why


@pytest.fixture(scope="module")
def hosts_run(tmp_path_factory):
  work = tmp_path_factory.mktemp("hosts") / "run"
  # A window of G = 8 groups: once rollout1's are stuck, at most one more step can
  # train before the release, so the release comes before the step-4 checkpoint and
  # the kill (with 2G, rollout0 could run ahead alone).
  report = launch(work, ["--link_down_at", "1", "--remote_timeout_s", str(TIMEOUT_S),
                         "--kill_trainers_at", "4"], ["JobConfig.window = 8"])
  return work, report


@needs_hosts
def test_hosts_reach_each_other_and_nothing_else(tmp_path):
  """The hosts' only network: each other's addresses. Unplugging cuts one off;
  killing a host ends its processes; leaving removes every namespace, and a crashed
  run's namespaces are removed by the next one."""
  server = ("import socket,sys; s=socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen();"
            "print('up', flush=True); c, a = s.accept(); print(a[0], flush=True); c.recv(1)")
  dial = ("import socket,sys\ntry: socket.create_connection((sys.argv[1], 7000), timeout=1.5)"
          "; print('reached')\nexcept OSError as e: print(type(e).__name__, e.errno)")

  def dial_from(hosts, host, address):
    return hosts.run(host, [sys.executable, "-c", dial, address], stdout=subprocess.PIPE,
                     text=True).communicate(timeout=30)[0].strip()

  dead = subprocess.Popen(["true"])
  dead.wait()  # its pid names a crashed run's namespace
  stale = f"{netns.PREFIX}{dead.pid}-0000-a"
  subprocess.run(["ip", "netns", "add", stale], check=True)
  with netns.TestHosts(["a", "b"]) as hosts:
    assert stale not in netns.namespaces()
    assert hosts.address("a") != hosts.address("b")
    up = hosts.run("b", [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    assert up.stdout.readline().strip() == "up"
    hosts.link_down("b")
    assert dial_from(hosts, "a", hosts.address("b")) == "TimeoutError None"
    hosts.link_up("b")
    assert dial_from(hosts, "a", hosts.address("b")) == "reached"
    assert up.stdout.readline().strip() == hosts.address("a")  # b saw a's own address
    # No route out of the switch: neither the machine's nor any other address.
    assert dial_from(hosts, "a", "10.0.0.1") == "OSError 101"  # ENETUNREACH
    assert dial_from(hosts, "a", "127.0.0.1") == "ConnectionRefusedError 111"  # its own lo
    sleeper = hosts.run("b", ["sleep", "600"])
    assert sleeper.pid in hosts.pids("b")
    hosts.kill_host("b")
    assert sleeper.wait(timeout=10) == -9 and hosts.pids("b") == []
    names = [hosts.ns(h) for h in ("a", "b", netns.SWITCH)]
  assert not set(names) & set(netns.namespaces())


@needs_hosts
def test_job_across_hosts_trains_every_trajectory_once(hosts_run):
  """(a) Trainers on trainer0/trainer1 (jax.distributed over their addresses),
  workers on rollout0/rollout1, the store on the store host: the job completes and
  trains every trajectory once, through both faults below."""
  work, report = hosts_run
  assert report["steps"] == STEPS
  assert len(set(report["hosts"].values())) == 5
  assert report["store_url"].startswith("s3://") and not (work / "store").exists()
  assert report["s3_endpoint"].startswith(f"http://{report['hosts']['store']}:")
  summary = json.loads((work / "summary.json").read_text())
  assert summary["steps"] == STEPS and summary["quota_violations"] == 0
  recs, ids = trained_once(work)
  # Each trainer host read its own half of what it trained since the restart.
  since = [i for r in recs if r["step"] > report["kill"]["checkpoint_step"] for i in r["ids"]]
  reads = [json.loads((work / "logs" / f"trainer{p}.json").read_text())["read_ids"]
           for p in range(2)]
  assert sorted(reads[0] + reads[1]) == sorted(since) and not set(reads[0]) & set(reads[1])
  # Every trajectory came from a worker that joined from a rollout host over TCP.
  workers = joined(controller_log(work))
  assert sorted(set(workers.values())) == ["rollout0", "rollout1"]
  assert {i.split("/")[0] for i in ids} <= {f"worker{w}" for w in workers}
  # Each worker's unit names the host it was written from.
  assert store_listing(work)["unit_hosts"] == {f"worker{w}": h for w, h in workers.items()}


@needs_hosts
def test_unplugged_rollout_host_is_released_and_its_groups_redispatched(hosts_run):
  """(b) rollout1's link goes down after step 1: after JobConfig.remote_timeout_s of
  silence the controller releases its worker and fails the groups it had not
  committed; their replacements train (rollout0 generates them), before the kill."""
  work, report = hosts_run
  down = report["link_down"]
  assert down["host"] == "rollout1" and down["after_step"] < STEPS
  assert 0 < down["release_s"] and down["at_s"] + down["release_s"] < report["kill"]["at_s"]
  log = controller_log(work)
  cut = [w for w, host in joined(log).items() if host == "rollout1"][0]  # its first worker
  released = re.findall(r"remote rollout worker (\d+) silent for ([\d.]+) s", log)
  assert (str(cut), f"{TIMEOUT_S:g}") in released
  summary = json.loads((work / "summary.json").read_text())
  assert summary["groups"]["failed"] >= 1  # what it held and had not committed
  assert summary["groups"]["trained"] == STEPS * 4  # replaced: every step still full


@needs_hosts
def test_job_resumes_after_its_trainer_hosts_are_killed(hosts_run):
  """(c) Every process on trainer0 and trainer1 SIGKILLed once the step-4 checkpoint
  is written, then both started again with --resume (and fresh workers): nothing
  trained twice (a), and every step the checkpoint held stands as it was."""
  work, report = hosts_run
  kill = report["kill"]
  assert kill["hosts"] == ["trainer0", "trainer1"]
  assert kill["checkpoint_step"] >= 4 and kill["after_step"] < STEPS  # really mid-job
  recs = records(work / "metrics.jsonl")
  before = {r["step"]: r["ids"] for r in records(work / "logs" / "metrics_at_kill.jsonl")}
  after = {r["step"]: r["ids"] for r in recs}
  for step in range(1, kill["checkpoint_step"] + 1):
    assert after[step] == before[step]
  workers = joined(controller_log(work))  # 2 joined each start, each with a new id
  assert len(workers) == 4 and sorted(workers.values()).count("rollout1") == 2
