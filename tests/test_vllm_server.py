"""The 'vllm_server' rollout engine against a vLLM server (the CPU build) that this module
starts once and stops, on the tiny random Llama the in-process engine's tests use:
seeds reproduce, behaviour log-probs equal the trainer's before and after a weight
update pushed through shared memory, versions bound what produced each response, and
a server that is not there, lacks the weight route or reports raw log-probs is a
clear error (those against small stand-in servers: no vLLM needed)."""
import http.server
import json
import os
import threading

import jax
import numpy as np
import pytest
from flax import nnx
from hf_helpers import make_checkpoint
from vllm_helpers import SAMPLER, SHAPE, requests, trainer_logprobs

from knittrans_jax.models import hf
from knittrans_jax.rollout.engine import EngineSpec, GroupRequest, response_seeds
from knittrans_jax.rollout.engines import make_engine
from knittrans_jax.rollout.vllm_server_engine import ServerError, VllmServerOptions


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("ckpt"))
  make_checkpoint("llama", path, seed=3, **SHAPE)
  m, config = hf.load(path)
  graphdef, params = nnx.split(m, nnx.Param)
  return path, config, graphdef, jax.device_get(params)


KEY_ENV = "KNITTRANS_TEST_VLLM_KEY"  # the test server's API key is in this variable


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
  """The server, started as a user's usually is: with an API key."""
  pytest.importorskip("vllm")
  from knittrans_jax.testing.vllm_server import start_vllm_server
  log = str(tmp_path_factory.mktemp("server") / "vllm.log")
  os.environ[KEY_ENV] = key = os.urandom(8).hex()
  try:
    with start_vllm_server(model[0], max_model_len=256, log_path=log, api_key=key) as s:
      yield s
  finally:
    os.environ.pop(KEY_ENV, None)


def engine_on(url, model, params=None, **options):
  _, config, graphdef, p = model
  spec = EngineSpec("vllm_server", config, SAMPLER, seed=0,
                    options=VllmServerOptions(urls=(url,), **options))
  return make_engine(spec, graphdef, p if params is None else params, 0)


def perturbed(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: np.asarray(x) + 0.05 * rng.standard_normal(x.shape).astype(x.dtype),
                      params)


@pytest.mark.slow
def test_server_responses_reproduce_and_log_probs_equal_the_trainers(server, model):
  _, config, graphdef, params = model
  engine = engine_on(server.url, model, api_key_env=KEY_ENV)
  try:
    assert engine.server_info["logprobs_mode"] == "processed_logprobs"
    first = engine.generate(requests(0, groups=2, n=3))
    again = engine.generate(requests(0, groups=2, n=3) + requests(5, groups=2, n=3))[:2]
    for a, b in zip(first, again):
      assert [r.tokens.tolist() for r in a.responses] == [r.tokens.tolist() for r in b.responses]
    assert len({tuple(r.tokens.tolist()) for r in first[0].responses}) > 1  # n seeds
    for g in first:
      assert g.seconds is not None and g.seconds > 0
      for r in g.responses:
        assert 1 <= r.tokens.size <= SAMPLER.max_new_tokens and r.versions == (0, 0)
        assert r.finish_reason == ("stop" if r.tokens[-1] == 1 else "length")
        ref = trainer_logprobs(graphdef, params, g.request.prompt, r.tokens, SAMPLER)
        np.testing.assert_allclose(r.logprobs, ref, atol=1e-4)

    # A new version through shared memory: what is sampled changes, and the log-probs
    # are the new weights' (the tied head re-packed too).
    new = perturbed(params, 5)
    engine.update_weights(1, new)
    assert engine.last_load["tensors"] == len(hf.decoder_tensors(params))
    assert engine.last_load["via"] == "segment"  # plain arrays: a segment written for them
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("knittrans-vllm-server-")]
    after = engine.generate(requests(0, groups=2, n=3))
    changed = 0
    for a, b in zip(after, first):
      for ra, rb in zip(a.responses, b.responses):
        assert ra.versions == (1, 1)
        changed += ra.tokens.tolist() != rb.tokens.tolist()
        ref = trainer_logprobs(graphdef, new, a.request.prompt, ra.tokens, SAMPLER)
        np.testing.assert_allclose(ra.logprobs, ref, atol=1e-4)
    assert changed

    # Requests in flight across an update: each response's versions hold every version
    # that can have produced its tokens; those sent after it are the new version's.
    engine.add(requests(20, groups=2, n=2))
    engine.update_weights(2, params)
    engine.add(requests(30, groups=1, n=2))
    done = {}
    while engine.busy:
      done.update({g.request.group_id: g for g in engine.step()})
    weights = {1: new, 2: params}
    for gid, g in done.items():
      for r in g.responses:
        # Sent before the update began, after it ended, or in between (sent at 1).
        assert r.versions in ((1, 1), (1, 2), (2, 2)) and (gid < 30 or r.versions == (2, 2))
        if r.versions[0] == r.versions[1]:  # one version: its log-probs exactly
          ref = trainer_logprobs(graphdef, weights[r.versions[0]], g.request.prompt, r.tokens,
                                 SAMPLER)
          np.testing.assert_allclose(r.logprobs, ref, atol=1e-4)
    assert len(engine.weight_update_s) == 2  # the start's load is not an update
  finally:
    engine.close()


@pytest.mark.slow
def test_published_weights_load_as_views_of_the_trainers_segment(server, model, tmp_path):
  """Weights as the job's workers receive them (views of the trainer's segment in
  /dev/shm, transport 'shm'): the server's workers map that segment itself, through
  this process's descriptor, even once its name is gone; nothing is written for them."""
  import jax.numpy as jnp

  from knittrans_jax.rollout.weight_subscriber import WeightSubscriber
  from knittrans_jax.rollout.weights import WeightPublisher, WeightSyncConfig
  _, config, graphdef, params = model
  engine = engine_on(server.url, model, api_key_env=KEY_ENV)
  pub = WeightPublisher(str(tmp_path), sync=WeightSyncConfig(transport="shm").resolve("local"),
                        version=0)
  try:
    new = perturbed(params, 8)
    pub.write_part(3, jax.tree.map(jnp.asarray, new))
    pub.commit(3)
    version, got = WeightSubscriber(str(tmp_path), params).poll()
    for name in os.listdir("/dev/shm"):  # the name goes (a newer commit would unlink it)
      if name.startswith(f"knittrans-{pub.tag}-"):
        os.unlink(os.path.join("/dev/shm", name))
    before = set(os.listdir("/dev/shm"))
    engine.update_weights(version, got)
    assert engine.last_load["via"] == "views" and engine.last_load["files"] == 1
    assert set(os.listdir("/dev/shm")) <= before  # no segment of the engine's own
    for g in engine.generate(requests(50, groups=2, n=2)):
      for r in g.responses:
        assert r.versions == (3, 3)
        ref = trainer_logprobs(graphdef, new, g.request.prompt, r.tokens, SAMPLER)
        np.testing.assert_allclose(r.logprobs, ref, atol=1e-4)
  finally:
    engine.close()
    pub.close()


@pytest.mark.slow
def test_keep_mode_salts_prefixes_with_the_version(server, model):
  """in_flight = 'keep': no reset of the requests in flight, and a request after the
  update on a prompt the old weights cached gets the new weights' log-probs exactly."""
  _, config, graphdef, params = model
  engine = engine_on(server.url, model, in_flight="keep", api_key_env=KEY_ENV)
  try:
    block = engine.server_info["block_size"]
    prompt = np.random.default_rng(7).integers(2, 64, block + 4).astype(np.int32)
    request = [GroupRequest(40, "x", prompt, 2, response_seeds(0, 40, 2))]
    engine.generate(request)  # its full blocks cached on the old weights
    new = perturbed(params, 6)
    engine.update_weights(1, new)
    for r in engine.generate(request)[0].responses:
      assert r.versions == (1, 1)
      ref = trainer_logprobs(graphdef, new, prompt, r.tokens, SAMPLER, block + 4 + 12)
      np.testing.assert_allclose(r.logprobs, ref, atol=1e-4)
  finally:
    engine.close()


@pytest.mark.slow
def test_a_job_rolls_out_on_the_server(server, model, tmp_path):
  """The job (synchronous, one worker) from the server's own checkpoint: every
  trajectory trained once, and on the steps whose rows the trainer's current weights
  generated (mini-batch 0 of each train batch) the server's behaviour log-probs equal
  the trainer's: the weights pushed each version are exact."""
  from test_job import finish, start

  from knittrans_jax.job.metrics import read_metrics
  work = tmp_path / "run"
  out = finish(start(work, "JobConfig.engine = 'vllm_server'", "JobConfig.workers = 1",
                     f"VllmServerOptions.urls = ('{server.url}',)",
                     f"VllmServerOptions.api_key_env = '{KEY_ENV}'",
                     f"JobConfig.checkpoint = '{model[0]}'", "JobConfig.mode = 'synchronous'"),
               timeout=300)
  summary = json.load(open(work / "summary.json"))
  recs = read_metrics(str(work))
  ids = [i for r in recs for i in r["ids"]]
  assert summary["steps"] == len(recs) == 6, out[-3000:]
  assert len(ids) == len(set(ids)) == 6 * 16 and summary["quota_violations"] == 0
  fresh = [r for r in recs if r["lag0_tokens"]]
  assert [r["step"] - 1 for r in fresh] == [0, 2, 4]
  assert all(r["logprob_abs_diff_max"] <= 1e-4 for r in fresh), [
      r["logprob_abs_diff_max"] for r in fresh]


@pytest.mark.slow
def test_a_client_without_the_servers_key_is_refused_by_name(server, model, monkeypatch):
  with pytest.raises(ServerError, match=r"answered GET /v1/models with HTTP 401(.|\n)*wants an "
                     r"API key: put it in an environment variable and name that variable in "
                     r"VllmServerOptions.api_key_env"):
    engine_on(server.url, model)
  monkeypatch.setenv("WRONG_KEY", "not-the-key")
  with pytest.raises(ServerError, match=r"HTTP 401(.|\n)*the one in \$WRONG_KEY was refused") as e:
    engine_on(server.url, model, api_key_env="WRONG_KEY")
  assert "not-the-key" not in str(e.value) and os.environ[KEY_ENV] not in str(e.value)
  monkeypatch.delenv("WRONG_KEY")
  with pytest.raises(ValueError, match=r"api_key_env = 'WRONG_KEY': that environment variable "
                     r"is not set"):
    engine_on(server.url, model, api_key_env="WRONG_KEY")
  with pytest.raises(ValueError, match=r"api_key_env = 'sk-1 2': name an environment variable"):
    VllmServerOptions(api_key_env="sk-1 2")


class _StandIn(http.server.BaseHTTPRequestHandler):
  """A server answering as a vLLM server started without what the engine needs."""
  answers: dict = {}
  bodies: list = []

  def _answer(self):
    length = int(self.headers.get("Content-Length") or 0)
    body = json.loads(self.rfile.read(length)) if length else None
    type(self).bodies.append((self.path, body))
    route = self.path.split("?")[0]
    key = route if body is None else f"{route} {body.get('method', '')}".strip()
    status, payload = self.answers.get(key, self.answers.get(route, (404, {"detail": "Not Found"})))
    data = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  do_GET = do_POST = _answer

  def log_message(self, *args):
    pass


@pytest.fixture
def stand_in():
  servers = []

  def start(answers):
    handler = type("Handler", (_StandIn,), {"answers": answers, "bodies": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    servers.append(httpd)
    return f"http://127.0.0.1:{httpd.server_address[1]}", handler

  yield start
  for s in servers:
    s.shutdown()
    s.server_close()


MODELS = {"/v1/models": (200, {"data": [{"id": "m"}]})}
GOOD = {"logprobs_mode": "processed_logprobs", "max_model_len": 256, "dtype": "float32",
        "vocab_size": 64, "block_size": 16}


def test_a_server_that_is_not_there_or_lacks_what_the_engine_needs_is_a_clear_error(
    stand_in, model):
  import socket
  with socket.socket() as s:  # a port nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  with pytest.raises(ServerError, match=rf"no answer from the vLLM server at http://127.0.0.1:{port}"):
    engine_on(f"http://127.0.0.1:{port}", model)
  url, _ = stand_in(MODELS)  # no dev mode: no /collective_rpc route
  with pytest.raises(ServerError, match=r"HTTP 404(.|\n)*VLLM_SERVER_DEV_MODE=1"):
    engine_on(url, model)
  raw = dict(MODELS, **{"/collective_rpc knittrans_check":
                        (200, {"results": [dict(GOOD, logprobs_mode="raw_logprobs")]})})
  url, _ = stand_in(raw)
  with pytest.raises(ServerError, match="reports log-probs as 'raw_logprobs'"):
    engine_on(url, model)
  short = dict(MODELS, **{"/collective_rpc knittrans_check":
                          (200, {"results": [dict(GOOD, max_model_len=8)]})})
  url, _ = stand_in(short)
  with pytest.raises(ServerError, match="max_model_len 8; this job's sequences need 64"):
    engine_on(url, model, max_model_len=64)
  # The weights rejected (no worker extension, or the path is another host's).
  rejects = dict(MODELS, **{
      "/collective_rpc knittrans_check": (200, {"results": [GOOD]}),
      "/collective_rpc knittrans_load_segment": (500, {"error": {"message": "no such file"}})})
  url, handler = stand_in(rejects)
  with pytest.raises(ServerError, match=r"HTTP 500: no such file(.|\n)*did not load version 0"):
    engine_on(url, model)
  assert [b["method"] for p, b in handler.bodies if p == "/collective_rpc"] == [
      "knittrans_check", "knittrans_load_segment"]
  assert not [f for f in os.listdir("/dev/shm") if f.startswith("knittrans-vllm-server-")]
  two = dict(MODELS, **{"/v1/models": (200, {"data": [{"id": "a"}, {"id": "b"}]})})
  url, _ = stand_in(two)
  with pytest.raises(ServerError, match=r"serves \['a', 'b'\]: name one in VllmServerOptions.model"):
    engine_on(url, model)


def test_server_options_and_job_settings_are_checked(stand_in, model):
  from knittrans_jax.admission import TrainBatchSpec
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.rollout import vllm_server_engine
  from knittrans_jax.testing import vllm_server
  assert vllm_server.EXTENSION == vllm_server_engine.EXTENSION  # the server the test starts
  with pytest.raises(ValueError, match="'ftp://x' is not an http://host:port URL"):
    VllmServerOptions(urls=("ftp://x",))
  with pytest.raises(ValueError, match="in_flight = 'hold'"):
    VllmServerOptions(in_flight="hold")
  with pytest.raises(ValueError, match=r"holds 1 server\(s\) .* rollout worker 1 needs its own"):
    VllmServerOptions(urls=("http://127.0.0.1:1",)).url_for(1)
  spec = TrainBatchSpec(group_size=4, groups_per_batch=8, num_mini_batches=2)
  with pytest.raises(ValueError, match="engine = 'vllm_server' with mode 'colocated'"):
    JobConfig(spec, micro_batch_size=8, engine="vllm_server", mode="colocated")
  # 'keep' salts each request's prefix with the version it was sent at.
  ok = dict(MODELS, **{
      "/collective_rpc knittrans_check": (200, {"results": [GOOD]}),
      "/collective_rpc knittrans_load_segment": (200, {"results": [{"tensors": 1}]}),
      "/reset_prefix_cache": (200, {"success": True}),
      "/v1/completions": (200, {"choices": [{"token_ids": [5, 1], "logprobs": {
          "token_logprobs": [-1.0, -2.0]}}]})})
  url, handler = stand_in(ok)
  engine = engine_on(url, model, in_flight="keep")
  try:
    (g,) = engine.generate(requests(0, groups=1, n=2))
    assert [r.tokens.tolist() for r in g.responses] == [[5, 1], [5, 1]]
    assert [r.finish_reason for r in g.responses] == ["stop", "stop"]
    sent = [b for p, b in handler.bodies if p == "/v1/completions"]
    salts = {b["cache_salt"] for b in sent}
    assert len(salts) == 1 and salts.pop().endswith("-v0") and len({b["seed"] for b in sent}) == 2
    assert all(b["prompt"] == requests(0, groups=1, n=2)[0].prompt.tolist() for b in sent)
    # The first load resets the server (whatever the mode); 'keep' updates do not.
    engine.update_weights(1, model[3])
    resets = [p for p, _ in handler.bodies if p.startswith("/reset_prefix_cache")]
    assert resets == ["/reset_prefix_cache?reset_running_requests=true"]
  finally:
    engine.close()
