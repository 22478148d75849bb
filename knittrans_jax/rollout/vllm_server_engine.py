"""The 'vllm_server' rollout engine: a vLLM server the user runs (its OpenAI-compatible
HTTP API), behind the engine interface (rollout/engine.py).

- Requests: each of a group's n responses is one `/v1/completions` request with its
  own seed (`response_seeds`, as every engine seeds a response; one request with
  n > 1 would seed response i with seed + i), token ids in (`prompt` as ids) and out
  (`return_token_ids`), the sampled token's log-prob of the distribution sampled (the
  server runs with `--logprobs-mode processed_logprobs`), stops as the in-process
  engine sets them. Up to `concurrency` requests are in flight (one HTTP connection
  each); the server batches them continuously. A group is returned at the first step
  after its last response arrives.
- Weights (`update_weights`): the server's workers load each version from shared
  memory through the `/collective_rpc` route (the server in dev mode, with this
  project's worker extension: rollout/vllm_weights.py): the published segment itself
  when the parameters are its views (the job's 'shm' transport), reached as
  /proc/PID/fd/FD, else a Hugging Face segment written for them
  (rollout/hf_segment.py). Paths and strides are all that travels, so the server runs
  on this host, as this user. Then, with `in_flight = 'reprefill'`, `/reset_prefix_cache`
  with `reset_running_requests` (requests in flight re-prefilled on the new weights,
  no old prefix reused); with 'keep', each request's prefix is salted with the engine
  and the version it was sent at. The engine's first load resets the server in
  either mode (nothing another engine left cached or running survives it).
- Versions: a response records (the version its request was sent at, the newest
  version whose update had started when it came back): a range holding every
  version that produced its tokens (a response that ended just before an update
  reads as mixed).
- `seconds` of a finished group: from its first request sent to its last response
  received, the server's queueing included (a server does not report when a request
  started decoding).

Start the server as docs/rollout.md ("An external vLLM server") says: the checks at
construction name any flag it lacks. One server per rollout worker
(VllmServerOptions.urls[i] for worker i): an update with reset_running_requests
preempts every request on the server, which a second worker would not know of.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import http.client
import json
import os
import threading
import time
import urllib.parse

import gin
import numpy as np

from knittrans_jax.rollout.engine import (EngineSpec, FinishedGroup, GroupRequest, Response,
                                          RolloutEngine)
from knittrans_jax.rollout.hf_segment import push_weights, wire_dtype
from knittrans_jax.rollout.vllm_engine import IN_FLIGHT_MODES

EXTENSION = "knittrans_jax.rollout.vllm_weights.WeightLoader"
SERVER_HINT = ("start it with VLLM_SERVER_DEV_MODE=1 (the /collective_rpc route) and "
               f"--worker-extension-cls {EXTENSION} --logprobs-mode processed_logprobs "
               "(docs/rollout.md, 'An external vLLM server')")
STEP_WAIT_S = 0.05  # a step waits this long for a response when none has arrived


@gin.configurable
@dataclasses.dataclass(frozen=True)
class VllmServerOptions:
  """urls: the servers, one per rollout worker (worker i uses urls[i]), e.g.
  'http://127.0.0.1:8000'; model: the served model's name (None: the server's only
  one); dtype: the weights' dtype on the way, the server's own (bf16 halves the
  bytes; its load casts anything else); in_flight: what an update does to requests in
  flight (vllm_engine.IN_FLIGHT_MODES); concurrency: requests in flight per engine;
  timeout_s: one HTTP call's (a response, a weight load); max_model_len: the longest
  sequence the engine sends (the job sets it), which the server's must hold;
  api_key_env: the name of the environment variable that holds the server's API key
  (a server started with --api-key or VLLM_API_KEY), read when the engine starts and
  sent as a bearer token; the key itself never goes in a config or a log. vLLM checks
  the key on its /v1 routes only: the dev-mode weight routes stay open, so a server
  should listen on loopback or a private network (docs/rollout.md)."""
  urls: tuple[str, ...] = ()
  model: str | None = None
  dtype: str = "float32"
  in_flight: str = "reprefill"
  concurrency: int = 64
  timeout_s: float = 600.0
  max_model_len: int | None = None
  api_key_env: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "urls", tuple(self.urls))
    if self.api_key_env is not None and not (isinstance(self.api_key_env, str)
                                             and self.api_key_env.isidentifier()):
      raise ValueError(f"VllmServerOptions.api_key_env = {self.api_key_env!r}: name an "
                       "environment variable (e.g. 'VLLM_API_KEY'), not the key")
    if self.in_flight not in IN_FLIGHT_MODES:
      raise ValueError(f"VllmServerOptions.in_flight = {self.in_flight!r}: one of "
                       f"{sorted(IN_FLIGHT_MODES)}")
    if self.concurrency < 1:
      raise ValueError(f"VllmServerOptions.concurrency = {self.concurrency}: must be >= 1")
    for url in self.urls:
      u = urllib.parse.urlparse(url)
      if u.scheme != "http" or not u.hostname:
        raise ValueError(f"VllmServerOptions.urls: {url!r} is not an http://host:port URL")

  def url_for(self, worker: int) -> str:
    if worker >= len(self.urls):
      raise ValueError(f"VllmServerOptions.urls holds {len(self.urls)} server(s) "
                       f"{list(self.urls)}; rollout worker {worker} needs its own (one server "
                       "per worker: JobConfig.workers <= len(urls))")
    return self.urls[worker]

  def api_key(self) -> str | None:
    """The key from the environment variable `api_key_env` names (None: no key)."""
    if self.api_key_env is None:
      return None
    key = os.environ.get(self.api_key_env)
    if not key:
      raise ValueError(f"VllmServerOptions.api_key_env = {self.api_key_env!r}: that environment "
                       "variable is not set (or empty) in the rollout worker's environment")
    return key


class ServerError(RuntimeError):
  """A vLLM server that is not there, answers an error, or lacks what the engine needs."""


class _Client:
  """HTTP/1.1 calls to one server, one persistent connection per calling thread."""

  def __init__(self, url: str, timeout_s: float, api_key: str | None = None,
               api_key_env: str | None = None):
    u = urllib.parse.urlparse(url)
    self.url, self.host, self.port = url.rstrip("/"), u.hostname, u.port or 80
    self.timeout_s, self.api_key_env = timeout_s, api_key_env
    self._auth = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    self._local = threading.local()

  def call(self, method: str, route: str, body: dict | None = None, timeout_s=None):
    """The decoded JSON answer (None for an empty one); ServerError otherwise."""
    data = None if body is None else json.dumps(body).encode()
    for attempt in (0, 1):  # a kept-alive connection the server closed: once more, fresh
      conn = getattr(self._local, "conn", None)
      fresh = conn is None
      if fresh:
        conn = self._local.conn = http.client.HTTPConnection(
            self.host, self.port, timeout=timeout_s or self.timeout_s)
      try:
        headers = dict(self._auth, **({"Content-Type": "application/json"} if data else {}))
        conn.request(method, route, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read()
        break
      except (ConnectionRefusedError, OSError, http.client.HTTPException) as e:
        conn.close()
        self._local.conn = None
        if fresh or attempt:
          raise ServerError(f"no answer from the vLLM server at {self.url} ({method} {route}): "
                            f"{type(e).__name__}: {e}") from None
    if resp.status >= 400:
      try:
        msg = json.loads(text)
        # {"error": {"message": ...}}, {"detail": ...} or {"error": "Unauthorized"} (401)
        err = msg.get("error") if isinstance(msg, dict) else None
        msg = ((err.get("message") if isinstance(err, dict) else err)
               or (msg.get("detail") if isinstance(msg, dict) else None) or msg)
      except ValueError:
        msg = text[:500].decode(errors="replace")
      hint = ""
      if resp.status == 401:  # the key's name only, never the key
        hint = ("\nThe server wants an API key: " + (
            f"the one in ${self.api_key_env} was refused" if self.api_key_env else
            "put it in an environment variable and name that variable in "
            "VllmServerOptions.api_key_env"))
      raise ServerError(f"the vLLM server at {self.url} answered {method} {route} with "
                        f"HTTP {resp.status}: {msg}{hint}")
    return json.loads(text) if text else None

  def close(self) -> None:
    conn = getattr(self._local, "conn", None)
    if conn is not None:
      conn.close()


class VllmServerEngine(RolloutEngine):
  name = "vllm_server"

  def __init__(self, spec: EngineSpec, params, version: int):
    opts = spec.options  # the root's (JobSetup.engine_options), never gin's from here
    if not isinstance(opts, VllmServerOptions):
      raise ValueError(f"EngineSpec.options = {opts!r}: the 'vllm_server' engine takes "
                       "VllmServerOptions (the job passes JobSetup.engine_options)")
    if spec.sampler.greedy:
      raise ValueError("SamplerConfig.greedy with the 'vllm_server' engine: greedy decoding "
                       "(held-out evaluation) runs on the JAX sampler")
    self.spec, self.options, self.version = spec, opts, version
    self.client = _Client(opts.url_for(spec.index), opts.timeout_s, opts.api_key(),
                          opts.api_key_env)
    self.model = opts.model or self._served_model()
    self._check_server()
    self._lock = threading.Lock()
    self._started_version = version  # the newest version whose update has begun
    self._pool = cf.ThreadPoolExecutor(opts.concurrency, thread_name_prefix="vllm-server")
    self._inflight: dict[cf.Future, tuple[int, int]] = {}  # -> (group id, response)
    self.groups: dict[int, tuple[GroupRequest, dict[int, Response]]] = {}
    self.started: dict[int, float] = {}
    self.weight_update_s: list[float] = []
    self.weight_bytes, self.last_load = 0, None
    # 'keep' salts prefixes per engine too: another engine's (another run's, a restarted
    # worker's) cached "v3" was computed by other weights.
    self._salt = os.urandom(4).hex()
    # The server holds these weights from now on, and nothing cached or running from
    # before (whatever the mode).
    self.update_weights(version, params, reset=True)
    self.weight_update_s.clear()  # the first load is start-up, not an update

  def _served_model(self) -> str:
    models = [m["id"] for m in (self.client.call("GET", "/v1/models") or {}).get("data", [])]
    if len(models) != 1:
      raise ServerError(f"the vLLM server at {self.client.url} serves {models}: name one in "
                        "VllmServerOptions.model")
    return models[0]

  def _check_server(self) -> None:
    """The settings the engine relies on, read from the server's worker."""
    try:
      got = self.client.call("POST", "/collective_rpc", {"method": "knittrans_check"})
    except ServerError as e:
      raise ServerError(f"{e}\nThe 'vllm_server' engine needs the server's weight route: "
                        f"{SERVER_HINT}") from None
    info = got["results"][0]
    if info["logprobs_mode"] != "processed_logprobs":
      raise ServerError(f"the vLLM server at {self.client.url} reports log-probs as "
                        f"{info['logprobs_mode']!r}; the behaviour log-probs must be the "
                        f"sampled distribution's: {SERVER_HINT}")
    need = self.options.max_model_len
    if need is not None and info["max_model_len"] < need:
      raise ServerError(f"the vLLM server at {self.client.url} has max_model_len "
                        f"{info['max_model_len']}; this job's sequences need {need} "
                        "(start it with --max-model-len)")
    if info["vocab_size"] < self.spec.model_config.vocab_size:
      raise ServerError(f"the vLLM server at {self.client.url} serves a vocabulary of "
                        f"{info['vocab_size']}; the policy's DecoderConfig.vocab_size is "
                        f"{self.spec.model_config.vocab_size} (serve this policy's shape)")
    self.server_info = info

  def _body(self, prompt: list[int], seed: int, salt: int) -> dict:
    s = self.spec.sampler
    body = {"model": self.model, "prompt": prompt, "max_tokens": s.max_new_tokens,
            "temperature": s.temperature, "top_p": s.top_p, "seed": seed, "logprobs": 0,
            "stop_token_ids": list(s.stop_tokens), "ignore_eos": True,
            # Token ids, never text: a server may have no tokenizer (--skip-tokenizer-init).
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    if self.options.in_flight == "keep":
      body["cache_salt"] = f"{self._salt}-v{salt}"
    return body

  def _complete(self, prompt: list[int], seed: int):
    """One response: (tokens, log-probs, finish reason, first version, last version)."""
    with self._lock:
      first = self.version
    out = self.client.call("POST", "/v1/completions", self._body(prompt, seed, first))
    with self._lock:
      last = self._started_version
    choice = out["choices"][0]
    tokens = choice.get("token_ids")
    if tokens is None:
      raise ServerError(f"the vLLM server at {self.client.url} returned no token ids "
                        "(return_token_ids): a vLLM older than this engine needs")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(logprobs) != len(tokens):
      raise ServerError(f"the vLLM server at {self.client.url} returned {len(logprobs)} "
                        f"log-probs for {len(tokens)} tokens")
    return tokens, logprobs, first, last

  def add(self, requests: list[GroupRequest]) -> None:
    for r in requests:
      if r.image is not None:
        raise ValueError(f"group {r.group_id}: the 'vllm_server' engine takes text prompts only")
      if r.tool is not None:
        raise ValueError(f"group {r.group_id} (source {r.source!r}) calls a tool mid-response, "
                         "which only the 'jax' engine inserts: run it with engine 'jax'")
      if r.group_id in self.groups:
        raise ValueError(f"group {r.group_id} is already in the engine")
    for r in requests:
      self.groups[r.group_id] = (r, {})
      self.started[r.group_id] = time.perf_counter()
      prompt = [int(t) for t in r.prompt]
      for i, seed in enumerate(r.seeds):
        self._inflight[self._pool.submit(self._complete, prompt, seed)] = (r.group_id, i)

  @property
  def busy(self) -> bool:
    return bool(self.groups)

  def step(self) -> list[FinishedGroup]:
    if not self._inflight:
      return []
    ready, _ = cf.wait(list(self._inflight), timeout=STEP_WAIT_S,
                       return_when=cf.FIRST_COMPLETED)
    done = []
    for f in ready:
      gid, i = self._inflight.pop(f)
      tokens, logprobs, first, last = f.result()  # a server error stops the worker, named
      req, responses = self.groups[gid]
      stop = bool(tokens) and tokens[-1] in self.spec.sampler.stop_tokens
      responses[i] = Response(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32),
                              "stop" if stop else "length", (first, last))
      if len(responses) == req.n:
        del self.groups[gid]
        done.append(FinishedGroup(req, tuple(responses[k] for k in range(req.n)),
                                  time.perf_counter() - self.started.pop(gid)))
    return done

  def update_weights(self, version: int, params, reset: bool = False) -> None:
    """`reset`: also preempt the requests running and drop the cached prefixes, as
    in_flight 'reprefill' always does."""
    t0 = time.perf_counter()
    with self._lock:
      self._started_version = max(self._started_version, version)
    def load(method: str, arg: str) -> dict:
      try:
        return self.client.call("POST", "/collective_rpc",
                                {"method": method, "args": [arg]})["results"][0]
      except ServerError as e:
        raise ServerError(f"{e}\nthe server did not load version {version} from shared memory "
                          f"({method}): the 'vllm_server' engine passes weights through "
                          "/dev/shm, so the server must run on this host, as this user, and "
                          f"have this project's worker extension ({SERVER_HINT})") from None
    self.weight_bytes, self.last_load = push_weights(
        params, version, wire_dtype(self.options.dtype),
        f"knittrans-vllm-server-{os.getpid()}-{id(self)}", load)
    if reset or self.options.in_flight == "reprefill":
      # Requests in flight re-prefilled on the new weights; no old prefix reused.
      ok = self.client.call("POST", "/reset_prefix_cache?reset_running_requests=true")
      if not (ok or {}).get("success"):
        raise ServerError(f"the vLLM server at {self.client.url} did not reset its prefix "
                          f"cache after loading version {version}: {ok}")
    with self._lock:
      self.version = version
    self.weight_update_s.append(time.perf_counter() - t0)

  def close(self) -> None:
    pool, self._pool = getattr(self, "_pool", None), None
    if pool is not None:
      pool.shutdown(wait=False, cancel_futures=True)
    self.client.close()
