"""A vLLM server (its OpenAI-compatible API) for tests and benchmarks, started as a user
would start one for the 'vllm_server' engine (rollout/vllm_server_engine.py):

    with start_vllm_server("/path/to/hf_checkpoint", max_model_len=256) as server:
      VllmServerOptions(urls=(server.url,))

`python -m vllm.entrypoints.openai.api_server` in a session of its own (it starts an
engine-core process: `stop()` ends the whole group), on 127.0.0.1 and a free port, in
dev mode with this project's worker extension and the sampled distribution's log-probs.
`start_vllm_server` returns once /health answers, or raises with the log's tail.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

# rollout/vllm_server_engine.EXTENSION (named here: this layer imports nothing above
# it; tests/test_vllm_server.py checks the two agree).
EXTENSION = "knittrans_jax.rollout.vllm_weights.WeightLoader"


def _free_port(host: str) -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class VllmServer:
  """A running server: `.url`, `.log_path`, `.stop()`; a context manager."""

  def __init__(self, proc: subprocess.Popen, url: str, log_path: str):
    self.proc, self.url, self.log_path = proc, url, log_path

  def log_tail(self, lines: int = 30) -> str:
    try:
      with open(self.log_path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    except OSError:
      return ""

  def stop(self, timeout_s: float = 30.0) -> None:
    if self.proc.poll() is not None:
      return
    os.killpg(self.proc.pid, signal.SIGTERM)
    try:
      self.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()

  def __enter__(self) -> VllmServer:
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


def server_command(model_dir: str, host: str, port: int, max_model_len: int,
                   dtype: str = "float32", seed: int = 0,
                   kv_cache_bytes: int = 64 << 20) -> list[str]:
  """The command line (the flags the 'vllm_server' engine needs, docs/rollout.md)."""
  return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
          "--host", host, "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
          "--dtype", dtype, "--logprobs-mode", "processed_logprobs",
          "--max-model-len", str(max_model_len), "--seed", str(seed),
          "--kv-cache-memory-bytes", str(kv_cache_bytes), "--worker-extension-cls", EXTENSION,
          "--disable-log-stats", "--enable-prefix-caching",
          # Whole prefills (the CPU build's seeded generators cannot rewind a split one).
          "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 8192))]


def start_vllm_server(model_dir: str, max_model_len: int = 256, host: str = "127.0.0.1",
                      timeout_s: float = 300.0, log_path: str | None = None,
                      api_key: str | None = None, **flags) -> VllmServer:
  """Starts a server on `model_dir` (a Hugging Face checkpoint directory) and waits for
  it to answer; `flags`: server_command's. `api_key`: the key its /v1 routes want (in
  the server's environment, VLLM_API_KEY, not on its command line)."""
  port = _free_port(host)
  if log_path is None:
    fd, log_path = tempfile.mkstemp(prefix="vllm_server_", suffix=".log")
    os.close(fd)
  env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="WARNING")
  env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
  env.pop("VLLM_API_KEY", None)
  if api_key is not None:
    env["VLLM_API_KEY"] = api_key
  with open(log_path, "w") as log:
    proc = subprocess.Popen(server_command(model_dir, host, port, max_model_len, **flags),
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
  server = VllmServer(proc, f"http://{host}:{port}", log_path)
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"the vLLM server on {model_dir} exited ({proc.returncode}) before "
                         f"answering; its log ({log_path}):\n{server.log_tail()}")
    try:
      with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
        if r.status == 200:
          return server
    except (urllib.error.URLError, OSError):
      pass
    time.sleep(0.25)
  server.stop()
  raise RuntimeError(f"the vLLM server on {model_dir} did not answer /health within "
                     f"{timeout_s:.0f} s; its log ({log_path}):\n{server.log_tail()}")
