"""Rollout workers on other hosts: the controller's request and report queues over TCP.

The controller serves them with `multiprocessing.managers` (authenticated by a
random key) and writes the address and key to WORKDIR/control.json, which a
remote worker reads from the shared work dir (scripts/rollout_worker.py). The
worker registers, gets a fresh worker id (so its own storage unit) and the job's
rollout settings, and runs the same `worker_main` as a local worker. It reaches
the store by its URL and the weights through the work dir.

Liveness: a remote worker sends ("alive", id) every `HEARTBEAT_S`; one silent for
`timeout_s` is treated like a dead local worker (its committed groups count, the
rest are re-dispatched, what it had not taken is dropped). If that same process
speaks again, its heartbeat makes it dispatchable again; a restarted worker joins
under a new id.
"""
from __future__ import annotations

import json
import os
import queue
import secrets
import socket
import threading
import time
from multiprocessing.managers import BaseManager, EventProxy

HEARTBEAT_S = 2.0
CONTROL_FILE = "control.json"


class _Manager(BaseManager):
  pass


class ControlServer:
  """The controller's side. `requests[w]` and `reports` are plain local queues here."""

  def __init__(self, workdir: str, address: str, first_id: int, worker_args: dict,
               timeout_s: float = 15.0, advertise: str | None = None):
    """`address` is where the server binds (HOST:PORT); `advertise` the host name or
    address written to control.json for workers to dial (default: the bound host,
    or this machine's hostname when bound to all interfaces)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
      raise ValueError(f"JobConfig.control_address = {address!r}: use HOST:PORT (port 0: any free)")
    self.requests: dict[int, queue.Queue] = {}
    self.reports: queue.Queue = queue.Queue()
    self.stop = threading.Event()
    self.timeout_s = timeout_s
    self.last_seen: dict[int, float] = {}
    self._next_id = first_id
    self._lock = threading.Lock()
    authkey = secrets.token_bytes(16)

    def join(hostname: str):
      with self._lock:
        w, self._next_id = self._next_id, self._next_id + 1
        self.requests[w] = queue.Queue()
      self.reports.put(("hello", w, hostname))
      return w, worker_args

    manager = type("ControlManager", (_Manager,), {})
    manager.register("join", callable=join)  # not "register": that name is the classmethod
    manager.register("requests", callable=lambda w: self.requests[w])
    manager.register("reports", callable=lambda: self.reports)
    manager.register("stop", callable=lambda: self.stop, proxytype=EventProxy)
    self._server = manager(address=(host, int(port)), authkey=authkey).get_server()
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                    name="control-server")
    self._thread.start()
    bound = self._server.address[1]
    advertised = advertise or (socket.gethostname() if host in ("0.0.0.0", "") else host)
    self.path = os.path.join(workdir, CONTROL_FILE)
    tmp = self.path + ".tmp"
    # Readable by this user only: the key lets a client run code in the controller
    # (managers unpickle what clients send). Renamed into place: never read half-written.
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
      json.dump({"host": advertised, "port": bound, "authkey": authkey.hex()}, f)
    os.replace(tmp, self.path)
    self.address = f"{advertised}:{bound}"

  def seen(self, w: int) -> None:
    self.last_seen[w] = time.monotonic()

  def alive(self) -> list[int]:
    now = time.monotonic()
    return [w for w, t in self.last_seen.items() if now - t < self.timeout_s]

  def silent(self) -> list[int]:
    now = time.monotonic()
    return [w for w, t in self.last_seen.items() if now - t >= self.timeout_s]

  def forget(self, w: int) -> None:
    """A silent worker: drop it and what it had not yet taken (already re-dispatched)."""
    self.last_seen.pop(w, None)
    q = self.requests.get(w)
    while q is not None:
      try:
        q.get_nowait()
      except queue.Empty:
        break

  def close(self) -> None:
    self.stop.set()
    for q in self.requests.values():
      q.put(None)
    # The server thread lives on until the process exits: a worker that connects
    # after this finds `stop` set and leaves at once.
    try:
      os.remove(self.path)
    except FileNotFoundError:
      pass


def connect(workdir: str, timeout_s: float = 300.0, name: str | None = None):
  """(worker id, rollout settings, requests, reports, stop) from a remote worker.

  Waits up to `timeout_s` for control.json and for its server to answer: a job that
  is restarting (`--resume`) leaves the previous run's file until it serves again.
  `name` is how the controller's log calls this worker (default: the hostname)."""
  path = os.path.join(workdir, CONTROL_FILE)
  deadline = time.monotonic() + timeout_s
  manager = type("ControlClient", (_Manager,), {})
  for method in ("join", "requests", "reports"):
    manager.register(method)
  manager.register("stop", proxytype=EventProxy)
  while True:
    try:
      with open(path) as f:
        info = json.load(f)
      m = manager(address=(info["host"], info["port"]), authkey=bytes.fromhex(info["authkey"]))
      m.connect()
      break
    except OSError as e:  # no file yet, or nothing serving at its address (yet)
      if time.monotonic() > deadline:
        why = ("no such file" if isinstance(e, FileNotFoundError)
               else f"{info['host']}:{info['port']} did not answer ({e.strerror or e})")
        raise TimeoutError(f"{path}: {why} after {timeout_s:.0f} s: is the job running with "
                           "JobConfig.control_address set, and is the work dir shared?") from e
      time.sleep(0.5)
  w, args = m.join(name or socket.gethostname())._getvalue()
  return w, args, m.requests(w), m.reports(), m.stop()
