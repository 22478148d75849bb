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
