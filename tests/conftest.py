import os
import sys

import gin
import pytest

# Make tests/ importable for helper modules and child-process scripts.
sys.path.insert(0, os.path.dirname(__file__))


# Files whose tests start a local Ray, jax.distributed processes, network-namespaced
# hosts or a vLLM engine: under pytest-xdist (make test) they run on one worker, one
# after another, so two clusters never race for ports, cores or memory.
_ONE_WORKER = ("test_ray_fleet.py", "test_netns_hosts.py", "test_distributed.py",
               "test_vllm_engine.py", "test_vllm_job.py")


def pytest_collection_modifyitems(config, items):
  for item in items:
    if os.path.basename(str(item.fspath)) in _ONE_WORKER:
      item.add_marker(pytest.mark.xdist_group("clusters"))


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()

@pytest.fixture(scope="session")
def local_ray(tmp_path_factory):
  """One local Ray for the suite, started by the first test that asks: bound to the
  loopback alias 127.0.0.2 (Ray replaces 127.0.0.1 with the host's routable address),
  token authentication on; yields the token file's path."""
  ray = pytest.importorskip("ray")
  from knittrans_jax.cluster import ray_setup
  work = tmp_path_factory.mktemp("ray")
  assert ray_setup.connect(ray_setup.RayConfig(node_address="127.0.0.2", num_cpus=8), str(work))
  yield str(work / "ray" / "auth_token")
  ray.shutdown()


# Tests are deterministic: hypothesis draws the same examples on every run.
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("deterministic", derandomize=True, print_blob=True)
_hyp_settings.load_profile("deterministic")
