"""Rollout workers share compiled sampler shapes: two processes whose JAX engines meet
the same shape at the same moment compile it once; the other loads it from the
persistent cache (compile_cache.py)."""
import multiprocessing as mp
import os

import pytest

pytestmark = pytest.mark.slow


def _worker(cache_dir: str, lock: bool, barrier, out) -> None:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "").replace(
      "--xla_force_host_platform_device_count=8", "")
  import contextlib

  import jax
  import numpy as np
  from flax import nnx

  from knittrans_jax import compile_cache
  from knittrans_jax.models import DecoderConfig, DecoderLM
  from knittrans_jax.rollout.engine import EngineSpec, GroupRequest
  from knittrans_jax.rollout.jax_engine import JaxEngine
  from knittrans_jax.rollout.sampler import SamplerConfig

  assert compile_cache.enable(None) == cache_dir
  if not lock:  # what the engine did before: every process compiles what it meets
    compile_cache.compiling = lambda key: contextlib.nullcontext()
  cfg = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64)
  with nnx.use_eager_sharding(False):
    graphdef, params = nnx.split(DecoderLM(cfg, nnx.Rngs(0)), nnx.Param)
  engine = JaxEngine(EngineSpec("jax", cfg, SamplerConfig(max_new_tokens=4), 0, 2),
                     graphdef, params, 0)
  engine.add([GroupRequest(g, "s", np.arange(2, 7, dtype=np.int32), 2, (g, g + 9))
              for g in range(2)])
  events = []
  jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
  barrier.wait()  # both meet the shape at once
  done = engine.step()
  asked = events.count("/jax/compilation_cache/compile_requests_use_cache")
  hits = events.count("/jax/compilation_cache/cache_hits")
  out.put((asked - hits, hits, [g.responses[0].tokens.tolist() for g in done]))


def _run(tmp_path, lock: bool):
  ctx = mp.get_context("spawn")
  barrier, out = ctx.Barrier(2), ctx.Queue()
  procs = [ctx.Process(target=_worker, args=(str(tmp_path / "cache"), lock, barrier, out))
           for _ in range(2)]
  for p in procs:
    p.start()
  for p in procs:
    p.join(120)
    assert p.exitcode == 0, "a worker failed (its traceback is above)"
  return sorted(out.get(timeout=5) for _ in procs)


def test_two_workers_compile_a_shape_once(tmp_path):
  (idle, hits, tokens_b), (first, _, tokens_a) = _run(tmp_path, lock=True)
  assert first > 0 and idle == 0 and hits == first  # one compiled; the other loaded it all
  assert tokens_a == tokens_b  # the loaded executable samples what the compiled one does


def test_without_the_lock_both_compile(tmp_path):
  """The control: what the lock removes is real (both miss the empty cache)."""
  (a, _, _), (b, _, _) = _run(tmp_path, lock=False)
  assert a > 0 and b > 0
