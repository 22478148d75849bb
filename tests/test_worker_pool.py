"""The local worker pool stops a run whose rollout worker cannot start (three deaths
in a row before its first group) with the worker's own error, instead of restarting
it until the stall timeout."""
import time

import pytest

from knittrans_jax.job.workers import MAX_COLD_DEATHS, WorkerPool
from knittrans_jax.models import DecoderConfig
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.suites import TextSuite
from knittrans_jax.rollout.worker import WorkerArgs
from knittrans_jax.storage import StoreSchema, TrajectoryStore

pytestmark = pytest.mark.slow


def test_a_worker_that_cannot_start_stops_the_pool_with_its_error(tmp_path):
  store = TrajectoryStore.create("file://" + str(tmp_path / "store"), StoreSchema(sources=("s",)))
  args = WorkerArgs(seed=0, n=2, model_config=DecoderConfig(vocab_size=64, width=32, depth=1,
                                                            heads=2, mlp_width=64),
                    sampler_config=SamplerConfig(), suite=TextSuite(),
                    groups_per_call=1, engine="jax", engine_options=None)
  logs = []
  # The workers are pointed at a store that does not exist: each dies at start.
  pool = WorkerPool(str(tmp_path), "file://" + str(tmp_path / "missing"), workers=1,
                    worker_args=args, store=store, log=logs.append)
  try:
    deadline = time.time() + 120
    with pytest.raises(RuntimeError) as e:
      while time.time() < deadline:
        pool.poll(0.2)
    assert f"rollout worker 0 died {MAX_COLD_DEATHS} times in a row" in str(e.value)
    assert "missing" in str(e.value)  # the worker's own error: the store it could not open
    assert pool.restarts == MAX_COLD_DEATHS - 1
  finally:
    pool.close()
