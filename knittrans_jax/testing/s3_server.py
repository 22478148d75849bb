"""A local S3-compatible server (moto) for tests, benchmarks and fault reports.

    with start_s3_server() as s3:
      s3.create_bucket("store")
      os.environ.update(s3.env)  # endpoint + dummy credentials, inherited by children
      TrajectoryStore.create("s3://store/run1", schema)

The server is a subprocess (`python -m knittrans_jax.testing.s3_server`), optionally
inside a network namespace (`ip netns exec NAME`). It binds its port itself (port 0
picks a free one), checks that it answers HTTP, and only then prints its port on the
first line of its log, so the parent never races the bind and the check works in any
namespace. moto keeps objects in the server's memory: stopping it loses them.
"""
import argparse
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

# Dummy credentials: moto accepts any signature, TensorStore and boto3 insist on some.
CREDENTIALS = {
  "AWS_ACCESS_KEY_ID": "testing",
  "AWS_SECRET_ACCESS_KEY": "testing",
  "AWS_REGION": "us-east-1",
}
_READY = "s3 server ready on port "


class S3Server:
  """A running moto server: `.endpoint`, `.env`, `.create_bucket(name)`, `.stop()`."""

  def __init__(self, proc, host, port, log_path, netns):
    self.proc, self.host, self.port, self.log_path, self.netns = proc, host, port, log_path, netns
    connect = "127.0.0.1" if host in ("0.0.0.0", "") else host
    self.endpoint = f"http://{connect}:{port}"

  @property
  def env(self):
    """The environment a process needs to reach this server by an s3:// URL: the
    standard AWS variables (boto3, aws-cli and the store's URL conversion read them)."""
    return dict(CREDENTIALS, AWS_ENDPOINT_URL_S3=self.endpoint)

  def create_bucket(self, name):
    """Creates bucket `name` (S3 rules: 3-63 characters, lower case, digits, '.', '-')."""
    self._request("PUT", f"{self.endpoint}/{name}")

  def _request(self, method, url):
    # A plain unsigned request: moto does not check signatures. Inside a namespace
    # the endpoint may be reachable only from there, so the request is sent from there.
    cmd = [sys.executable, "-m", "knittrans_jax.testing.s3_server", "--request", method, url]
    if self.netns is not None:
      cmd = ["ip", "netns", "exec", self.netns] + cmd
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"s3 server {self.endpoint}: {method} {url} failed: "
                         f"{done.stderr.strip()[-2000:]}")

  def log_tail(self, lines=40):
    with open(self.log_path, errors="replace") as f:
      return "".join(f.readlines()[-lines:])

  def stop(self):
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    if os.path.exists(self.log_path):
      os.remove(self.log_path)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


def start_s3_server(host="127.0.0.1", port=0, netns=None, timeout_s=60.0):
  """Starts a moto S3 server on host:port (0: a free port), in network namespace
  `netns` if given, and returns once it answers HTTP. Raises RuntimeError with the
  server's log tail if it exits or does not answer within timeout_s."""
  log_path = tempfile.mkstemp(prefix="s3_server_", suffix=".log")[1]
  cmd = [sys.executable, "-m", "knittrans_jax.testing.s3_server", "--host", host,
         "--port", str(port)]
  if netns is not None:
    cmd = ["ip", "netns", "exec", netns] + cmd
  with open(log_path, "wb") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
  deadline = time.monotonic() + timeout_s
  while True:
    with open(log_path, errors="replace") as f:
      first = f.readline()
    if first.startswith(_READY) and first.endswith("\n"):
      return S3Server(proc, host, int(first[len(_READY):]), log_path, netns)
    if proc.poll() is not None or time.monotonic() > deadline:
      server = S3Server(proc, host, port, log_path, netns)
      why = f"exited with code {proc.returncode}" if proc.poll() is not None else \
        f"did not answer within {timeout_s:.0f} s"
      tail = server.log_tail()
      server.stop()
      raise RuntimeError(f"s3 server {' '.join(cmd)!r} {why}; its log ends:\n{tail}")
    time.sleep(0.05)


def _serve(host, port):
  from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app)
  from werkzeug.serving import make_server
  logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
  server = make_server(host, port, DomainDispatcherApplication(create_backend_app), threaded=True,
                       request_handler=MotoRequestHandler)
  port = server.server_port
  os.environ["MOTO_PORT"] = str(port)  # moto builds some URLs from it
  threading.Thread(target=server.serve_forever, daemon=True).start()
  connect = "127.0.0.1" if host in ("0.0.0.0", "") else host
  urllib.request.urlopen(f"http://{connect}:{port}/moto-api/", timeout=30).read()
  print(_READY + str(port), flush=True)
  threading.Event().wait()  # until SIGTERM


def _send(method, url):
  try:
    urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30).read()
  except urllib.error.HTTPError as e:
    sys.exit(f"HTTP {e.code}: {e.read().decode(errors='replace')}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--request", nargs=2, metavar=("METHOD", "URL"),
                      help="send one unsigned request to a running server instead")
  args = parser.parse_args(argv)
  if args.request:
    _send(*args.request)
  else:
    _serve(args.host, args.port)


if __name__ == "__main__":
  main()
