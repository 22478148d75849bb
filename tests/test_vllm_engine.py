"""The 'vllm' rollout engine (vLLM's CPU build, in this process) on a tiny random Llama
checkpoint (head dim 32, the CPU kernels' smallest): seeds reproduce, behaviour
log-probs equal the trainer's, a weight update equals a fresh engine on the new
weights, requests in flight across an update record both versions (re-prefilled, or
sampling on the kept KV with VllmOptions.in_flight = 'keep')."""
import dataclasses
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from hf_helpers import make_checkpoint
from vllm_helpers import SAMPLER, SHAPE, requests, trainer_logprobs

from knittrans_jax.models import hf
from knittrans_jax.rollout.engine import EngineSpec, GroupRequest, ToolInsert, response_seeds
from knittrans_jax.rollout.engines import make_engine
from knittrans_jax.rollout.vllm_engine import VllmOptions

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("ckpt"))
  make_checkpoint("llama", path, seed=3, **SHAPE)
  m, config = hf.load(path)
  graphdef, params = nnx.split(m, nnx.Param)
  return config, graphdef, jax.device_get(params)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
  config, graphdef, params = model
  e = make_engine(EngineSpec("vllm", config, SAMPLER, seed=0, options=VllmOptions(),
                             workdir=str(tmp_path_factory.mktemp("engine"))), graphdef, params, 0)
  yield e
  e.close()


def with_sampler(engine, sampler):
  # The engine reads its sampling settings per request from its spec.
  engine.spec = dataclasses.replace(engine.spec, sampler=sampler)


def test_seeded_responses_reproduce_whatever_else_is_in_the_batch(engine):
  with_sampler(engine, SAMPLER)
  alone = engine.generate(requests(0, groups=1))
  crowded = engine.generate(requests(0, groups=1) + requests(1, groups=3))
  again = [r.tokens.tolist() for r in alone[0].responses]
  assert again == [r.tokens.tolist() for r in crowded[0].responses]
  assert len({tuple(t) for t in again}) > 1  # n seeds, n different responses
  for g in crowded:
    for r in g.responses:
      assert 1 <= r.tokens.size <= SAMPLER.max_new_tokens and r.logprobs.shape == r.tokens.shape
      assert r.finish_reason == ("stop" if r.tokens[-1] == 1 else "length")
      assert (r.tokens[:-1] != 1).all() and r.versions == (0, 0)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.9)])
def test_behaviour_logprobs_equal_the_trainers(engine, model, temperature, top_p):
  config, graphdef, params = model
  sampler = dataclasses.replace(SAMPLER, temperature=temperature, top_p=top_p)
  with_sampler(engine, sampler)
  worst = 0.0
  for g in engine.generate(requests(10 + int(100 * temperature * top_p))):
    for r in g.responses:
      ref = trainer_logprobs(graphdef, params, g.request.prompt, r.tokens, sampler)
      worst = max(worst, float(np.abs(r.logprobs - ref).max()))
  assert worst <= 1e-4, worst


def test_requests_in_flight_across_an_update_continue_on_the_new_weights(engine, model):
  """Tokens sampled before the update keep the old weights' log-probs; the requests are
  re-prefilled and every later token is the new weights' (teacher-forced trainer
  forward on the whole sequence); both versions are recorded."""
  config, graphdef, params = model
  sampler = dataclasses.replace(SAMPLER, stop_tokens=())  # every response runs to the length
  with_sampler(engine, sampler)
  new = jax.tree.map(lambda x: np.asarray(x) * np.float32(1.3), params)
  engine.add(requests(60, groups=2))
  assert engine.step() == []  # prefill and first tokens: in flight
  before = {rid: len(p[1]) for rid, p in engine.partial.items()}
  assert before and all(0 < k < sampler.max_new_tokens for k in before.values()), before
  engine.update_weights(2, new)
  done = []
  while engine.busy:
    done += engine.step()
  assert len(done) == 2
  for g in done:
    for i, r in enumerate(g.responses):
      k = before[f"{g.request.group_id}:{i}"]
      assert r.versions == (0, 2) and r.tokens.size == sampler.max_new_tokens
      assert r.finish_reason == "length"
      old = trainer_logprobs(graphdef, params, g.request.prompt, r.tokens, sampler)
      fresh = trainer_logprobs(graphdef, new, g.request.prompt, r.tokens, sampler)
      np.testing.assert_allclose(r.logprobs[:k], old[:k], atol=1e-4)
      np.testing.assert_allclose(r.logprobs[k:], fresh[k:], atol=1e-4)
      assert np.abs(old[k:] - fresh[k:]).max() > 1e-2  # the two weights differ there
  engine.update_weights(0, params)


def test_keep_mode_samples_on_the_old_kv_and_reuses_no_old_prefix(engine, model):
  """VllmOptions.in_flight = 'keep' (PipelineRL's): requests in flight keep the KV the
  old weights computed, so their later tokens are not the re-prefilled ones; a request
  after the update on the same prompt, whose full blocks the old weights cached, gets
  the new weights' log-probs exactly (its prefix is salted with its version)."""
  config, graphdef, params = model
  sampler = dataclasses.replace(SAMPLER, stop_tokens=())
  with_sampler(engine, sampler)
  block = engine.engine.vllm_config.cache_config.block_size
  prompt = np.random.default_rng(7).integers(2, 64, block + 4).astype(np.int32)
  length = block + 4 + sampler.max_new_tokens + 2

  def request(gid):
    return GroupRequest(gid, "x", prompt, 2, response_seeds(0, gid, 2))

  new = jax.tree.map(lambda x: np.asarray(x) * np.float32(1.3), params)
  old_options = engine.options
  engine.options = dataclasses.replace(old_options, in_flight="keep")
  try:
    engine.add([request(70)])
    assert engine.step() == []
    before = {rid: len(p[1]) for rid, p in engine.partial.items()}
    engine.update_weights(2, new)
    done = []
    while engine.busy:
      done += engine.step()
    for i, r in enumerate(done[0].responses):
      k = before[f"70:{i}"]
      old = trainer_logprobs(graphdef, params, prompt, r.tokens, sampler, length)
      fresh = trainer_logprobs(graphdef, new, prompt, r.tokens, sampler, length)
      assert r.versions == (0, 2) and 0 < k < r.tokens.size
      np.testing.assert_allclose(r.logprobs[:k], old[:k], atol=1e-4)
      assert np.abs(r.logprobs[k:] - fresh[k:]).max() > 1e-3  # the old KV, not re-prefilled
    for r in engine.generate([request(71)])[0].responses:
      assert r.versions == (2, 2)
      fresh = trainer_logprobs(graphdef, new, prompt, r.tokens, sampler, length)
      np.testing.assert_allclose(r.logprobs, fresh, atol=1e-4)
  finally:
    engine.options = old_options
    engine.update_weights(0, params)
  with pytest.raises(ValueError, match=r"VllmOptions.in_flight = 'hold': one of"):
    VllmOptions(in_flight="hold")


def test_in_flight_modes_side_by_side_measure_keeps_log_prob_gap(engine, model):
  """scripts/bench_in_flight.py's comparison on this engine: after an update mid-response
  'reprefill' samples exactly the new weights' distribution (the trainer's forward on
  the new weights), 'keep' does not (the old KV), tokens before the update are the old
  weights' in both, and the engine is back on the old weights after it."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("bench_in_flight", "scripts/bench_in_flight.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  config, graphdef, params = model
  sampler = dataclasses.replace(SAMPLER, stop_tokens=())
  with_sampler(engine, sampler)
  new = jax.tree.map(lambda x: np.asarray(x) * np.float32(1.3), params)

  def logprobs(p, prompt, tokens):
    return trainer_logprobs(graphdef, p, prompt, tokens, sampler)
  old_options = engine.options
  try:
    out = bench.compare(engine, params, new, requests(80, groups=2, n=2), update_at=4,
                        repeats=1, logprobs=logprobs)
  finally:
    engine.options = old_options
  keep, re = out["modes"]["keep"], out["modes"]["reprefill"]
  for r in (keep, re):
    assert r["runs"][0]["gap_after"]["tokens"] == 4 * (sampler.max_new_tokens - 4)
    assert r["gap_before_max"] <= 1e-4 and r["update_s"] > 0 and r["tokens_per_s"] > 0
  assert re["gap_after_max"] <= 1e-4 and out["floor"]["max"] <= 1e-4
  assert keep["gap_after_max"] > 1e-3 and out["keep_vs_reprefill"]["gap_after_mean"] > 10
  g = engine.generate(requests(84, groups=1, n=1))[0]
  np.testing.assert_allclose(g.responses[0].logprobs, logprobs(params, g.request.prompt,
                                                               g.responses[0].tokens), atol=1e-4)


def test_a_missing_vllm_a_small_head_or_an_unsupported_mode_is_a_clear_error(monkeypatch, model,
                                                                             engine):
  from knittrans_jax.rollout import vllm_engine
  config = model[0]
  # What only the JAX sampler does (a tool's insertion mid-response, an image) is refused.
  plain = requests(90, groups=1)[0]
  with pytest.raises(ValueError, match="calls a tool mid-response"):
    engine.add([dataclasses.replace(plain, tool=ToolInsert(9, np.array([10, 16], np.int32)))])
  with pytest.raises(ValueError, match="takes text prompts only"):
    engine.add([dataclasses.replace(plain, image=np.zeros((16, 16, 3), np.float32))])
  assert not engine.busy
  with pytest.raises(ValueError, match="head dim 16 < 32"):
    vllm_engine.check_model(dataclasses.replace(config, head_dim=16))
  from knittrans_jax.admission import TrainBatchSpec
  from knittrans_jax.job.config import JobConfig
  SPEC = TrainBatchSpec(group_size=4, groups_per_batch=8, num_mini_batches=2)
  with pytest.raises(ValueError, match="engine = 'vllm' with mode 'colocated'"):
    JobConfig(SPEC, micro_batch_size=8, engine="vllm", mode="colocated")
  with pytest.raises(ValueError, match="engine = 'vllm' with suite 'vision'"):
    JobConfig(SPEC, micro_batch_size=8, engine="vllm", suite="vision")
  with pytest.raises(ValueError, match="engine = 'sglang'"):
    JobConfig(SPEC, micro_batch_size=8, engine="sglang")
  monkeypatch.setitem(sys.modules, "vllm", None)
  with pytest.raises(RuntimeError, match="make install-vllm"):
    vllm_engine.check_available()


def test_weight_update_equals_a_fresh_engine_on_the_new_weights(engine, model, tmp_path):
  config, graphdef, params = model
  with_sampler(engine, SAMPLER)
  rng = np.random.default_rng(5)
  new = jax.tree.map(lambda x: np.asarray(x) + 0.05 * rng.standard_normal(x.shape).astype(x.dtype),
                     params)
  before = engine.generate(requests(40))
  engine.update_weights(1, new)
  after = engine.generate(requests(40))
  fresh = make_engine(EngineSpec("vllm", config, SAMPLER, seed=0, workdir=str(tmp_path),
                                 options=VllmOptions()),
                      graphdef, new, 1)
  # Two in-process engines share vLLM's process-wide parallel state, which closing
  # either one tears down: this test is the module engine's last use.
  try:
    want = fresh.generate(requests(40))
  finally:
    fresh.close()
  changed = 0
  for a, w, b in zip(after, want, before):
    for ra, rw, rb in zip(a.responses, w.responses, b.responses):
      assert ra.tokens.tolist() == rw.tokens.tolist() and ra.versions == (1, 1)
      np.testing.assert_allclose(ra.logprobs, rw.logprobs, atol=1e-5)
      changed += ra.tokens.tolist() != rb.tokens.tolist()
  assert changed  # the update did change what is sampled
  # And the new log-probs are the new weights' (the tied head re-packed too).
  r = after[0].responses[0]
  np.testing.assert_allclose(r.logprobs, trainer_logprobs(graphdef, new, after[0].request.prompt,
                                                          r.tokens, SAMPLER), atol=1e-4)
