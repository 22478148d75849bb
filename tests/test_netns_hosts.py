"""The job on a Ray cluster across hosts on one machine: each host a network namespace
(knittrans_jax/testing/netns.py), token authentication on.

  head      Ray head (GCS), the driver (scripts/train.py), trainer 0, rollout actor 0
  trainer1  a Ray node: trainer 1 (jax.distributed with trainer 0 over the hosts'
            addresses; gloo listens on each node's address)
  rollout1  a Ray node: rollout actor 1; its link is cut after step 1

One run shows: a client on another host without the token is refused; the cut node
is declared dead within 10 s (health checks every 1 s, cluster/ray_setup.py) and the
groups its actor held are re-dispatched; the job completes, every trajectory trained
once, no quota violated. Skipped, with the reason, without root or namespaces.
"""
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from knittrans_jax.cluster.ray_setup import HEALTH_CHECK, write_token
from knittrans_jax.job.metrics import read_metrics
from knittrans_jax.testing import netns

OK, WHY = netns.available()
needs_hosts = pytest.mark.skipif(not OK, reason=f"no test hosts here: {WHY}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6  # configs/text_grpo_test.gin, 3 train batches of 2 mini-batches
ROWS = 16  # trajectories a step trains (g = 4 groups x n = 4)
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
PORT = 6380


def placed(work):
  """role -> the node addresses it ran on, in order (logs/actors.log)."""
  nodes = {}
  for line in (work / "logs" / "actors.log").read_text().splitlines():
    role, _, address = line.split()
    nodes.setdefault(role, []).append(address)
  return nodes


def test_available_says_why_not(monkeypatch):
  """Without root or `ip` the hosts tests skip with this reason, never pass."""
  monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
  assert netns.available() == (False, "network namespaces need root (euid is 1000)")
  monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
  monkeypatch.setattr(netns.shutil, "which", lambda name: None)
  ok, why = netns.available()
  assert not ok and "no `ip` binary" in why


@needs_hosts
@pytest.mark.slow
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


class Cluster:
  """A Ray cluster on TestHosts: `ray start` on every host, each with its own temp dir."""

  def __init__(self, hosts, token, tmp):
    self.hosts, self.tmp = hosts, tmp
    self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
                "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token, "JAX_PLATFORMS": "cpu"}
    self.head = f"{hosts.address('head')}:{PORT}"

  def start(self, host, resources, head=False):
    cmd = [RAY, "start", "--node-ip-address", self.hosts.address(host), "--num-cpus", "4",
           "--resources", json.dumps(resources), "--temp-dir", f"/tmp/kr{os.getpid()}{host}",
           "--disable-usage-stats"]
    cmd += (["--head", "--port", str(PORT), "--include-dashboard", "false",
             "--system-config", json.dumps(HEALTH_CHECK)] if head else ["--address", self.head])
    return self.hosts.run(host, cmd, env=self.env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def dial(hosts, host, address, env):
  code = ("from ray._raylet import GcsClient\n"
          f"print('answered', GcsClient(address={address!r}).internal_kv_get(b'k', None))")
  return hosts.run(host, [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT, text=True).communicate(timeout=60)[0]


@pytest.fixture(scope="module")
def ray_hosts_run(tmp_path_factory):
  if not OK:
    pytest.skip(f"no test hosts here: {WHY}")
  tmp = tmp_path_factory.mktemp("rayhosts")
  work = tmp / "run"
  token = write_token(str(tmp / "token"))
  with netns.TestHosts(["head", "trainer1", "rollout1"]) as hosts:
    cluster = Cluster(hosts, token, tmp)
    out = cluster.start("head", {"trainer_host": 1, "rollout_host": 1}, head=True).communicate(
        timeout=120)[0]
    assert "Ray runtime started" in out, out[-3000:]
    joins = [cluster.start("trainer1", {"trainer_host": 1}),
             cluster.start("rollout1", {"rollout_host": 1})]
    outs = [j.communicate(timeout=120)[0] for j in joins]
    assert all("Ray runtime started" in o for o in outs), outs
    # From another host, without the token: refused; with it: answered.
    plain = {k: v for k, v in cluster.env.items() if not k.startswith("RAY_")}
    plain["HOME"] = str(tmp)
    refused = dial(hosts, "rollout1", cluster.head, plain)
    allowed = dial(hosts, "rollout1", cluster.head, cluster.env)
    bindings = ["JobConfig.cluster = 'ray'", f"RayConfig.address = '{cluster.head}'",
                f"RayConfig.token_path = '{token}'", "RayConfig.trainers = 2",
                "RayConfig.devices_per_trainer = 2",
                "RayConfig.trainer_resources = {'CPU': 1, 'trainer_host': 1}",
                "RayConfig.rollout_resources = {'CPU': 1, 'rollout_host': 1}",
                "RayConfig.rollout_strategy = 'STRICT_SPREAD'",
                # One group per call and a window of one train batch: rollout1's groups
                # hold its train batch back until they are re-dispatched.
                "JobConfig.groups_per_call = 1", "JobConfig.window = 8"]
    cmd = [sys.executable, "scripts/train.py", "--gin_file", "configs/text_grpo_test.gin",
           "--workdir", str(work)]
    for b in bindings:
      cmd += ["--gin_bindings", b]
    driver = hosts.run("head", cmd, env={**cluster.env, "PYTHONUNBUFFERED": "1"}, cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, seen = [], {}

    def read():
      for line in driver.stdout:
        lines.append(line)
        if re.search(r"rollout actor \d died", line):
          seen.setdefault("died", (time.monotonic(), line))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    cut = None
    deadline = time.monotonic() + 300
    while driver.poll() is None and time.monotonic() < deadline:
      if cut is None and read_metrics(str(work), partial=True):
        hosts.link_down("rollout1")
        cut = time.monotonic()
      time.sleep(0.05)
    if driver.poll() is None:
      driver.kill()
    driver.wait(timeout=30)
    reader.join(timeout=10)
    output = "".join(lines)
    (tmp / "driver.log").write_text(output)
    assert driver.returncode == 0, output[-5000:]
    yield dict(work=work, output=output, refused=refused, allowed=allowed, cut=cut,
               detected=seen.get("died"), addresses={h: hosts.address(h) for h in
                                                     ("head", "trainer1", "rollout1")})


@needs_hosts
@pytest.mark.slow
def test_ray_job_across_hosts_trains_every_trajectory_once(ray_hosts_run):
  r = ray_hosts_run
  work = r["work"]
  summary = json.loads((work / "summary.json").read_text())
  assert summary["cluster"] == "ray" and summary["steps"] == STEPS
  assert summary["quota_violations"] == 0
  recs = read_metrics(str(work))
  ids = [i for rec in recs for i in rec["ids"]]
  assert [rec["step"] for rec in recs] == list(range(1, STEPS + 1))
  assert len(ids) == len(set(ids)) == STEPS * ROWS, "a trajectory trained twice, or missing"
  # The trainers: one per trainer host, jax.distributed over the hosts' addresses.
  nodes = placed(work)
  a = r["addresses"]
  assert {nodes["trainer0"][0], nodes["trainer1"][0]} == {a["head"], a["trainer1"]}
  assert f"coordinator {nodes['trainer0'][0]}:" in r["output"]
  trainers = [json.loads((work / "logs" / f"trainer{p}.json").read_text()) for p in (0, 1)]
  assert [t["processes"] for t in trainers] == [2, 2]
  # Locality: the planner knows each trainer's node and the node each unit's actor
  # registered. rollout actor 0's unit is on head, so head's trainer reads some of its
  # rows locally; trainer1's host holds no unit, so its trainer reads nothing locally.
  on = {nodes[f"trainer{p}"][0]: t for p, t in enumerate(trainers)}
  assert on[a["head"]]["bytes_local"] > 0 and on[a["trainer1"]]["bytes_local"] == 0
  assert all(t["bytes_local"] <= t["bytes_read"] for t in trainers)
  assert summary["local_fraction"] > 0 and all(rec["local_fraction"] is not None for rec in recs)
  # Weights went through Ray's object store (WeightSyncConfig 'auto' on Ray): each
  # version's parts from both trainer hosts to the rollout hosts, no files written.
  latest = json.loads((work / "weights" / "LATEST").read_text())
  assert latest["version"] >= 1 and latest["ray"].startswith("knittrans-weights-")
  assert [d for d in os.listdir(work / "weights") if d.startswith("v")] == []


@needs_hosts
@pytest.mark.slow
def test_a_client_without_the_token_is_refused(ray_hosts_run):
  assert "InvalidAuthToken" in ray_hosts_run["refused"], ray_hosts_run["refused"][-2000:]
  assert "answered" in ray_hosts_run["allowed"], ray_hosts_run["allowed"][-2000:]


@needs_hosts
@pytest.mark.slow
def test_a_cut_link_is_detected_within_10_s_and_its_groups_redispatched(ray_hosts_run):
  r = ray_hosts_run
  assert r["cut"] is not None and r["detected"] is not None, r["output"][-4000:]
  t, line = r["detected"]
  assert 0 < t - r["cut"] < 10.0, t - r["cut"]
  # The actor that died is the one that ran on rollout1. (Its STRICT_SPREAD bundle has
  # no other node to go to, so the run finishes on the head's actor alone.)
  cut = next(role for role, nodes in placed(r["work"]).items()
             if nodes[0] == r["addresses"]["rollout1"])
  assert f"rollout actor {cut[len('rollout'):]} died" in line and "re-dispatching" in line
  summary = json.loads((r["work"] / "summary.json").read_text())
  assert summary["worker_restarts"] == 1 and summary["groups"].get("failed", 0) > 0
