"""The fleet on Ray on this machine (cluster/), on the suite's local Ray (conftest.py:
bound to the loopback alias 127.0.0.2, token authentication on). The driver is this
test process.

- the token file is owner-only, and a client without the token is refused;
- a job with a rollout actor SIGKILLed and another one SIGSTOPped (hung): both
  restarted, their groups re-dispatched, every trajectory trained once;
A trainer actor killed (the group rebuilt and resumed) is tests/test_distributed.py's
run; the job across namespaced hosts, with a link cut, is tests/test_netns_hosts.py.
"""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
from test_job import check_trained

from knittrans_jax import gin_cli
from knittrans_jax.cluster import ray_setup
from knittrans_jax.job.metrics import read_metrics

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
STEPS = 6  # configs/text_grpo_test.gin: 3 train batches of 2 mini-batches


def parse(workdir, *bindings):
  gin_cli.parse(argparse.Namespace(
      gin_file=["configs/text_grpo_test.gin"], workdir=str(workdir), gin_bindings=[
          "JobConfig.cluster = 'ray'", "RayConfig.trainer_strategy = 'PACK'", *bindings]))


def pid_file(workdir, name):
  with open(os.path.join(workdir, "logs", f"{name}.pid")) as f:
    return int(f.read())


def after_steps(workdir, steps, action, timeout=240):
  """Runs `action()` on a thread once metrics.jsonl has `steps` records."""
  done = threading.Event()

  def watch():
    deadline = time.time() + timeout
    while time.time() < deadline:
      if len(read_metrics(str(workdir), partial=True)) >= steps:
        action()
        break
      time.sleep(0.05)
    done.set()
  threading.Thread(target=watch, daemon=True).start()
  return done


def _dial(address, env):
  """A Ray client's first call on the cluster's GCS (what ray.init makes first; ray.init
  itself retries for 20 s before it gives up)."""
  code = ("from ray._raylet import GcsClient\n"
          f"print('answered', GcsClient(address={address!r}).internal_kv_get(b'k', None))")
  return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=60)


def test_token_owner_only_and_a_client_without_it_refused(local_ray, tmp_path):
  assert os.stat(local_ray).st_mode & 0o777 == 0o600
  address = ray.get_runtime_context().gcs_address
  env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
  env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token to fall back on
  refused = _dial(address, env)
  assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
  wrong = tmp_path / "wrong"
  wrong.write_text("0" * 64)
  refused = _dial(address, {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)})
  assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
  allowed = _dial(address, {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": local_ray})
  assert allowed.returncode == 0 and "answered" in allowed.stdout, allowed.stderr[-2000:]
  # A readable token file is refused by name.
  loose = tmp_path / "token"
  loose.write_text("x")
  loose.chmod(0o644)
  with pytest.raises(PermissionError, match="token_path = .* has mode 0o644"):
    ray_setup.check_token_file(str(loose))


def test_a_multi_node_cluster_without_a_token_is_refused(monkeypatch):
  fake = types.SimpleNamespace(nodes=lambda: [{"Alive": True}, {"Alive": True}],
                               shutdown=lambda: None)
  monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
  with pytest.raises(PermissionError, match="2 nodes without token authentication"):
    ray_setup._check_secure(ray_setup.RayConfig(), fake)
  ray_setup._check_secure(ray_setup.RayConfig(allow_insecure=True), fake)
  monkeypatch.setenv("RAY_AUTH_MODE", "token")
  ray_setup._check_secure(ray_setup.RayConfig(), fake)


def test_rollout_actors_killed_or_hung_are_restarted_and_nothing_is_lost(local_ray, tmp_path,
                                                                       capsys):
  from knittrans_jax.launch import run
  work = str(tmp_path / "run")
  # A window of one train batch (G = 8): the groups stuck on the hung worker hold its
  # train batch back, so the run ends only if the hang is caught.
  parse(work, "JobConfig.groups_per_call = 1", "JobConfig.window = 8",
        "RayConfig.call_deadline_s = 6")
  stopped = []

  def kill_one():
    os.kill(pid_file(work, "rollout0"), signal.SIGKILL)

  def hang_one():
    pid = pid_file(work, "rollout1")
    os.kill(pid, signal.SIGSTOP)  # alive to Ray, silent: only the call deadline catches it
    stopped.append(pid)
  killed = after_steps(work, 1, kill_one)
  hung = after_steps(work, 2, hang_one)
  try:
    summary = run(work)
  finally:
    for pid in stopped:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  assert killed.is_set() and hung.is_set() and stopped
  check_trained(work, STEPS)
  assert summary["worker_restarts"] >= 2, summary
  out = capsys.readouterr().out
  assert out.count("rollout actor 0 died") == 1 and "rollout actor 1 hung: group" in out, out[-3000:]
  assert summary["cluster"] == "ray" and summary["trainer_rebuilds"] == 0
