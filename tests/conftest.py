import os
import sys

import gin
import pytest

# Make tests/ importable for helper modules and child-process scripts.
sys.path.insert(0, os.path.dirname(__file__))


# Files whose tests start a local Ray, jax.distributed processes, network-namespaced
# hosts or a vLLM engine: under pytest-xdist (make test, --dist loadgroup) they run on
# one worker, one after another, so two clusters never race for ports, cores or
# memory, and each module-scoped cluster is started once.
_ONE_WORKER = ("test_ray_fleet.py", "test_netns_hosts.py", "test_distributed.py",
               "test_vllm_engine.py", "test_vllm_job.py", "test_weight_objects.py")
# Files whose tests share an expensive module-scoped fixture (a job run, a checkpoint):
# each file runs on one worker, so the fixture is built once, not once per worker.
_FILE_TOGETHER = ("test_vlm_job.py", "test_vlm_qwen_job.py", "test_qwen_vl_encode_once.py",
                  "test_bench_transfer.py", "test_vllm_server.py")


def pytest_xdist_make_scheduler(config, log):
  """loadgroup with the group decided here, from the test's file (the two lists above).
  (xdist 3.8 groups by a suffix it appends to `item._nodeid`, which pytest 9 no longer
  reads, so `xdist_group` markers group nothing under these versions.)"""
  if config.getvalue("dist") != "loadgroup":
    return None
  from xdist.scheduler import LoadGroupScheduling

  class ClusterFilesTogether(LoadGroupScheduling):
    def _split_scope(self, nodeid: str) -> str:
      name = nodeid.split("::")[0].rsplit("/", 1)[-1]
      if name in _ONE_WORKER:
        return "clusters"
      return name if name in _FILE_TOGETHER else nodeid

  return ClusterFilesTogether(config, log)


def pytest_collection_modifyitems(config, items):
  """The one-worker group (the clusters, run one after another) first, then the tests
  marked slow, then the rest, each in file order: the long serial group starts at once
  on one worker while the other takes everything else, instead of starting last and
  leaving a worker idle at the end."""
  def rank(item) -> int:
    if item.nodeid.split("::")[0].rsplit("/", 1)[-1] in _ONE_WORKER:
      return 0
    return 1 if item.get_closest_marker("slow") else 2
  items.sort(key=rank)  # stable: file order within each rank


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
  token = str(work / "ray" / "auth_token")
  yield token
  ray.shutdown()
  _kill_strays(token)


def _kill_strays(token: str) -> list[int]:
  """Kills the processes of this Ray session still alive after ray.shutdown(): those
  started with its token file (RAY_AUTH_TOKEN_PATH, unique to the session). An actor
  process whose raylet is gone can wait minutes for the GCS to come back (a
  `WeightRegistry` actor outlived a clean-clone suite by 12 minutes, 2026-12-07); the
  suite must leave no process behind."""
  import signal
  mine, killed = f"RAY_AUTH_TOKEN_PATH={token}".encode(), []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == os.getpid():
      continue
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        if mine not in f.read().split(b"\0"):
          continue
      os.kill(int(pid), signal.SIGKILL)
      killed.append(int(pid))
    except (OSError, ProcessLookupError):
      pass  # gone already, or not ours to read
  if killed:
    print(f"\nkilled {len(killed)} process(es) of the suite's Ray left after ray.shutdown(): "
          f"{killed}", file=sys.stderr)
  return killed


# Tests are deterministic: hypothesis draws the same examples on every run.
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("deterministic", derandomize=True, print_blob=True)
_hyp_settings.load_profile("deterministic")
