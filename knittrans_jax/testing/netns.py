"""Several hosts on one machine: network namespaces joined by a switch.

  with TestHosts(["store", "trainer0", "rollout0"]) as hosts:
    proc = hosts.run("trainer0", [sys.executable, "scripts/train.py", ...])
    hosts.address("store")          # '10.203.0.1'
    hosts.link_down("rollout0")     # cut that host off the switch
    hosts.kill_host("trainer0")     # SIGKILL every process in its namespace

Each host is a namespace with `lo` up and one veth `eth0` with an address in a
private /24. The other end of every veth sits in a switch namespace, on a bridge,
so nothing is added to the root namespace (the veth ends only pass through it)
and nothing inside can reach any address but its own loopback and the other hosts:
there is no route out. Processes share the file system (a work dir is shared, as
NFS would be). Needs root and iproute2's `ip`; `available()` says why not.

Names carry this process's pid (`knittrans-PID-host`): runs in parallel do not
collide, and namespaces left by a run that crashed (its pid gone) are removed when
the next TestHosts starts.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid

PREFIX = "knittrans-"
SWITCH = "switch"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
  out = subprocess.run(["ip", *args], capture_output=True, text=True)
  if check and out.returncode:
    raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
  return out


def namespaces() -> list[str]:
  out = _ip("netns", "list", check=False).stdout
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _pids(ns: str) -> list[int]:
  return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def _kill_all(ns: str) -> list[int]:
  """SIGKILLs every process in `ns` (again, for any started meanwhile) until none is
  left or 2.5 s have passed; returns the pids killed."""
  killed = set()
  for _ in range(50):
    pids = _pids(ns)
    if not pids:
      break
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
      except ProcessLookupError:
        pass
    time.sleep(0.05)
  return sorted(killed)


def _delete(ns: str) -> None:
  """Kills what runs in `ns`, then removes it (its veth ends go with it)."""
  _kill_all(ns)
  _ip("netns", "del", ns, check=False)


def remove_stale() -> list[str]:
  """Namespaces of an earlier TestHosts whose process is gone; returns their names."""
  stale = []
  for ns in namespaces():
    pid = ns[len(PREFIX):].split("-", 1)[0]
    if ns.startswith(PREFIX) and pid.isdigit() and not _alive(int(pid)):
      _delete(ns)
      stale.append(ns)
  return stale


def available() -> tuple[bool, str]:
  """(True, '') when hosts can be made here, else (False, why not)."""
  if os.geteuid() != 0:
    return False, f"network namespaces need root (euid is {os.geteuid()})"
  if shutil.which("ip") is None:
    return False, "no `ip` binary (Debian: apt-get install iproute2)"
  probe = f"{PREFIX}{os.getpid()}-probe-{uuid.uuid4().hex[:6]}"
  out = _ip("netns", "add", probe, check=False)
  if out.returncode:
    return False, f"cannot create a network namespace: {out.stderr.strip()}"
  _ip("netns", "del", probe, check=False)
  return True, ""


class TestHosts:
  """N named hosts on one switch (see the module doc). A context manager: leaving
  it, however, kills every process on the hosts and removes every namespace."""

  __test__ = False  # not a pytest test class

  def __init__(self, hosts: list[str], subnet: str = "10.203.0"):
    if len(set(hosts)) != len(hosts) or not hosts:
      raise ValueError(f"TestHosts: hosts = {hosts} must be distinct names, at least one")
    if len(hosts) > 250:
      raise ValueError(f"TestHosts: {len(hosts)} hosts do not fit one /24")
    bad = [h for h in hosts if not h.replace("_", "").isalnum() or h == SWITCH]
    if bad:
      raise ValueError(f"TestHosts: host names {bad} must be alphanumeric (and not {SWITCH!r})")
    self.hosts = list(hosts)
    self.subnet = subnet
    self.tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:4]}"
    self._created: list[str] = []

  def ns(self, host: str) -> str:
    if host not in self.hosts and host != SWITCH:
      raise KeyError(f"TestHosts: no host {host!r}; the hosts are {self.hosts}")
    return f"{self.tag}-{host}"

  def address(self, host: str) -> str:
    return f"{self.subnet}.{self.hosts.index(host) + 1}"

  def _port(self, host: str) -> str:
    return f"port{self.hosts.index(host)}"  # the switch's end of the host's veth

  def __enter__(self) -> "TestHosts":
    ok, why = available()
    if not ok:
      raise RuntimeError(f"TestHosts: {why}")
    remove_stale()
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def _build(self) -> None:
    sw = self.ns(SWITCH)
    _ip("netns", "add", sw)
    self._created.append(sw)
    _ip("-n", sw, "link", "add", "br0", "type", "bridge")
    _ip("-n", sw, "link", "set", "br0", "up")
    for i, host in enumerate(self.hosts):
      ns = self.ns(host)
      _ip("netns", "add", ns)
      self._created.append(ns)
      _ip("-n", ns, "link", "set", "lo", "up")
      # Made in the root namespace under names unique to this run, then both ends
      # moved out at once: nothing stays behind in the root namespace.
      a, b = f"kt{os.getpid()}h{i}", f"kt{os.getpid()}s{i}"
      _ip("link", "add", a, "type", "veth", "peer", "name", b)
      _ip("link", "set", a, "netns", ns)
      _ip("link", "set", b, "netns", sw)
      _ip("-n", ns, "link", "set", a, "name", "eth0")
      _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
      _ip("-n", ns, "link", "set", "eth0", "up")
      _ip("-n", sw, "link", "set", b, "name", self._port(host))
      _ip("-n", sw, "link", "set", self._port(host), "master", "br0", "up")

  def run(self, host: str, argv: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    """`argv` as a process on `host` (its own session, so signals reach only it).
    Returns once the process is in the host's namespace, so `kill_host` finds it."""
    popen.setdefault("start_new_session", True)
    proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], env=env, **popen)
    target = os.stat(f"/run/netns/{self.ns(host)}").st_ino
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
      try:
        if os.stat(f"/proc/{proc.pid}/ns/net").st_ino == target:
          break
      except FileNotFoundError:
        break
      time.sleep(0.005)
    return proc

  def link_down(self, host: str) -> None:
    """Unplugs the host: its switch port goes down, packets to and from it are lost
    (connections are not reset, as when a cable or a rack switch fails)."""
    _ip("-n", self.ns(SWITCH), "link", "set", self._port(host), "down")

  def link_up(self, host: str) -> None:
    _ip("-n", self.ns(SWITCH), "link", "set", self._port(host), "up")

  def pids(self, host: str) -> list[int]:
    return _pids(self.ns(host))

  def kill_host(self, host: str) -> list[int]:
    """SIGKILLs every process on the host (as a machine that loses power); returns
    their pids once they are gone."""
    return _kill_all(self.ns(host))

  def close(self) -> None:
    for ns in reversed(self._created):
      _delete(ns)
    self._created = []

  def __exit__(self, *exc) -> None:
    self.close()
