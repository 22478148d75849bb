"""WeightSyncConfig.transport = 'ray' (rollout/weight_objects.py) on the suite's local
Ray: a version is one object per trainer process in the engine's dtype, readers on the
node get read-only views of the object store (in this process and in another one), a
newer commit releases the older version while a reader holding it keeps valid arrays,
and missing parts, a wrong dtype or a run that is not on Ray are clear errors. Across
hosts the job runs on this transport in tests/test_netns_hosts.py and
tests/test_distributed.py (two trainer processes, each publishing its shards)."""
import os
import time

import jax
import ml_dtypes
import numpy as np
import pytest

from knittrans_jax.rollout import weight_objects
from knittrans_jax.rollout.weight_subscriber import WeightSubscriber, WeightSyncError
from knittrans_jax.rollout.weights import WeightPublisher, WeightSyncConfig, wire_template

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SYNC = WeightSyncConfig(transport="ray")


def params(scale: float):
  rng = np.random.default_rng(0)
  return {"embed": (scale * rng.normal(size=(64, 16))).astype(np.float32),
          "layers": {"w": (scale * rng.normal(size=(2, 16, 16))).astype(np.float32),
                     "step": np.array([7, 8], np.int32)}}


def _read_in_another_process(workdir: str, template):
  sub = WeightSubscriber(workdir, template)
  v, tree = sub.poll()
  w = tree["layers"]["w"]
  return v, float(np.asarray(w, np.float32).sum()), bool(w.flags.writeable), bool(w.flags.owndata)


def test_ray_transport_publishes_once_reads_views_and_releases(local_ray, tmp_path):
  work = str(tmp_path)
  driver = WeightPublisher(work, sync=SYNC)  # creates the registry, as RayTrainerGroup does
  trainer = WeightPublisher(work, process=0, version=0, sync=SYNC, dtype="bfloat16")
  template = wire_template(params(1.0), "bfloat16")
  sub = WeightSubscriber(work, template)
  assert sub.poll() is None  # nothing committed yet

  trainer.write_part(1, params(1.0))
  with pytest.raises(RuntimeError, match=r"parts \[1\] of 2 are not in the registry"):
    driver.commit(1, parts=2)
  driver.commit(1)
  reg = weight_objects.registry(driver.registry_name, create=False)
  (ref,), = ray.get(reg.get.remote(1))
  # One object for the part, in bfloat16: every leaf's bytes once (plus pickling's few).
  size = ray.experimental.get_object_locations([ref])[ref]["object_size"]
  wire = 2 * (64 * 16 + 2 * 16 * 16) + 4 * 2
  assert wire <= size < wire + 4096, size

  v, tree = sub.poll()
  assert v == 1 and sub.poll() is None
  want = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16) if x.dtype == np.float32 else x,
                      params(1.0))
  for got, exp in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
    assert got.dtype == exp.dtype and np.array_equal(got, exp)
    assert not got.flags.writeable and not got.flags.owndata  # a view of the object store
  # Another process on the node (a Ray task) maps the same object.
  task = ray.remote(_read_in_another_process).options(runtime_env={"env_vars": {
      "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}})
  v2, total, writeable, owndata = ray.get(task.remote(work, template), timeout=120)
  assert (v2, writeable, owndata) == (1, False, False)
  assert total == pytest.approx(float(want["layers"]["w"].astype(np.float32).sum()))

  # A newer version: the registry drops v1; the arrays this reader holds stay valid.
  held = tree["embed"]
  trainer.write_part(2, params(2.0))
  driver.commit(2)
  assert ray.get(reg.get.remote(1)) is None
  v, newer = sub.poll()
  assert v == 2 and np.array_equal(newer["embed"], 2 * held.astype(np.float32))
  assert np.array_equal(held, want["embed"])

  # The template's dtype must be the published one.
  with pytest.raises(WeightSyncError, match="dtype bfloat16, the model's float32"):
    WeightSubscriber(work, wire_template(params(1.0), None)).poll()
  # A restarting trainer group (process 0 with its start version) forgets what the old
  # one published: readers wait for its first version.
  WeightPublisher(work, process=0, version=2, sync=SYNC)
  assert WeightSubscriber(work, template).poll() is None
  assert ray.get(reg.get.remote(2)) is None
  # The creator's close ends the registry (no actor outlives the run).
  driver.close()
  deadline = time.monotonic() + 30  # ray.kill is asynchronous
  with pytest.raises(RuntimeError, match="no weight registry"):
    while time.monotonic() < deadline:
      weight_objects.registry(driver.registry_name, create=False)
      time.sleep(0.1)


def test_ray_transport_needs_the_ray_cluster(monkeypatch):
  assert WeightSyncConfig().resolve("ray").transport == "ray"
  with pytest.raises(ValueError, match="transport = 'ray' with JobConfig.cluster = 'local'"):
    SYNC.resolve("local")
  with pytest.raises(ValueError, match="transport = 'shm' with JobConfig.cluster = 'ray'.*'ray'"):
    WeightSyncConfig(transport="shm").resolve("ray")
  monkeypatch.setattr(ray, "is_initialized", lambda: False)
  with pytest.raises(RuntimeError, match="needs this process connected to Ray"):
    weight_objects.registry("x", create=True)
