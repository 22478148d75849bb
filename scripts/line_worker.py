"""A long-lived worker process driven by JSON lines (scripts/bench_vs_transferqueue.py's
two sides): `serve` is the worker's loop, `Worker` the orchestrator's handle on one.
Imported by path from scripts/ in both venvs (stdlib only)."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading

PROTO = "@@"  # a worker's reply line starts with this


def serve(handlers):
  """A worker's loop: a JSON request a line on stdin, a PROTO-prefixed JSON reply on
  stdout. Anything else printing to stdout (libraries, Ray) goes to stderr."""
  proto = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  sys.stdout = sys.stderr

  def reply(obj):
    proto.write(PROTO + json.dumps(obj) + "\n")
    proto.flush()
  try:
    reply({"ready": True, **handlers["setup"]()})
    for line in sys.stdin:
      req = json.loads(line)
      if req["op"] == "close":
        break
      reply(handlers[req["op"]](**req.get("args", {})))
  except BaseException as e:  # the orchestrator reports it
    import traceback
    reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    raise
  finally:
    handlers["close"]()
    reply({"closed": True})


class Worker:
  """One side's long-lived worker process and its reply stream."""

  def __init__(self, name, cmd, cwd, env=None):
    self.name = name
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=env, start_new_session=True, cwd=cwd)
    self.lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._pump, daemon=True).start()

  def _pump(self):
    for line in self.proc.stdout:
      if line.startswith(PROTO):
        self.lines.put(json.loads(line[len(PROTO):]))
      else:
        sys.stderr.write(f"[{self.name}] {line}")
    self.lines.put(None)

  def recv(self, timeout):
    try:
      msg = self.lines.get(timeout=timeout)
    except queue.Empty:
      raise TimeoutError(f"{self.name}: no answer in {timeout} s") from None
    if msg is None:
      raise RuntimeError(f"{self.name}: the worker exited (code {self.proc.wait()})")
    if "error" in msg:
      raise RuntimeError(f"{self.name}: {msg['error']}\n{msg.get('traceback', '')}")
    return msg

  def call(self, op, timeout, **kw):
    self.proc.stdin.write(json.dumps({"op": op, "args": kw}) + "\n")
    self.proc.stdin.flush()
    return self.recv(timeout)

  def close(self, timeout=120):
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=timeout)
      except (OSError, subprocess.TimeoutExpired):
        pass
    if self.proc.poll() is None:  # its own process group: the worker and what it started
      try:
        os.killpg(self.proc.pid, 9)
      except ProcessLookupError:
        pass
      self.proc.wait()
