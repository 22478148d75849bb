"""The control channel for rollout workers on other hosts (rollout/remote.py)."""
import json

import pytest

from knittrans_jax.rollout.remote import ControlServer, connect


def test_register_dispatch_report_and_stop(tmp_path):
  server = ControlServer(str(tmp_path), "localhost:0", first_id=3, worker_args={"seed": 7})
  info = json.loads((tmp_path / "control.json").read_text())
  assert info["port"] > 0 and len(bytes.fromhex(info["authkey"])) == 16
  w, args, requests, reports, stop = connect(str(tmp_path), timeout_s=5)
  assert (w, args) == (3, {"seed": 7})
  assert server.reports.get(timeout=5)[:2] == ("hello", 3)
  server.requests[3].put((11, "count"))  # the controller dispatches a group
  assert requests.get(timeout=5) == (11, "count")
  reports.put(("done", 3, 11, [], 0.25))  # the worker reports it
  assert server.reports.get(timeout=5) == ("done", 3, 11, [], 0.25)
  server.seen(3)
  assert server.alive() == [3] and server.silent() == []
  w2 = connect(str(tmp_path), timeout_s=5)[0]
  assert w2 == 4  # a second worker gets its own id, so its own unit
  assert not stop.is_set()
  server.close()
  assert stop.is_set() and requests.get(timeout=5) is None
  assert not (tmp_path / "control.json").exists()


def test_silent_worker_is_forgotten_with_its_queue(tmp_path):
  server = ControlServer(str(tmp_path), "localhost:0", first_id=0, worker_args={},
                         timeout_s=0.0)
  connect(str(tmp_path), timeout_s=5)
  server.seen(0)
  server.requests[0].put((1, "count"))
  assert server.silent() == [0]
  server.forget(0)
  assert server.requests[0].empty() and server.alive() == []
  server.close()


def test_errors_name_the_value(tmp_path):
  with pytest.raises(ValueError, match="control_address = 'nohost'"):
    ControlServer(str(tmp_path), "nohost", 0, {})
  with pytest.raises(TimeoutError, match="control.json"):
    connect(str(tmp_path / "elsewhere"), timeout_s=0.1)


def test_advertised_address_and_a_restarting_job(tmp_path):
  """Bound to all interfaces, the server writes the advertised host for workers to
  dial. A worker that finds a dead job's control.json keeps trying until the job
  serves again (a --resume), and says which address refused it if it never does."""
  import threading

  server = ControlServer(str(tmp_path), "0.0.0.0:0", first_id=0, worker_args={},
                         advertise="127.0.0.1")
  info = json.loads((tmp_path / "control.json").read_text())
  assert info["host"] == "127.0.0.1" and server.address == f"127.0.0.1:{info['port']}"
  assert connect(str(tmp_path), timeout_s=5, name="rollout7")[0] == 0
  assert server.reports.get(timeout=5) == ("hello", 0, "rollout7")
  stale = (tmp_path / "control.json").read_text()
  server.close()
  (tmp_path / "control.json").write_text(stale.replace(str(info["port"]), "1"))  # nothing serves
  with pytest.raises(TimeoutError, match=r"127.0.0.1:1 did not answer \(Connection refused\)"):
    connect(str(tmp_path), timeout_s=0.5)
  restarted = []
  timer = threading.Timer(0.5, lambda: restarted.append(
      ControlServer(str(tmp_path), "localhost:0", first_id=5, worker_args={})))
  timer.start()
  assert connect(str(tmp_path), timeout_s=10)[0] == 5
  restarted[0].close()


def test_remote_timeout_must_exceed_the_heartbeat():
  from knittrans_jax.admission import TrainBatchSpec
  from knittrans_jax.job.config import JobConfig
  spec = TrainBatchSpec(group_size=4, groups_per_batch=8, num_mini_batches=2)
  with pytest.raises(ValueError, match="remote_timeout_s = 2 must exceed the 2 s heartbeat"):
    JobConfig(spec=spec, micro_batch_size=8, remote_timeout_s=2)
  assert JobConfig(spec=spec, micro_batch_size=8, remote_timeout_s=2.5).remote_timeout_s == 2.5
