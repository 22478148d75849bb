"""The run profile (knittrans_jax/cpu_profile.py): CPU by phase, compilation as
start-up, the rest as `other`, summed per trajectory with the cores' idle time."""
import json
import os
import subprocess
import sys

import pytest

from knittrans_jax import cpu_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import time
from knittrans_jax import cpu_profile
from knittrans_jax.cpu_profile import phase
cpu_profile.start("trainer", compute_phase="train_step")
import threading
import jax, jax.numpy as jnp

def spin(seconds):
  t = time.thread_time()
  while time.thread_time() - t < seconds:
    pass

f = jax.jit(lambda x: jnp.tanh(x @ x.T) @ x)
x = jnp.ones((384, 384))
with phase("controller"):  # before the loop started: start-up
  f(x).block_until_ready()
  spin(0.2)
cpu_profile.loop_started()
with phase("controller"):
  spin(0.3)
def read():
  with phase("store_read"):  # another Python thread's phase
    spin(0.15)
t = threading.Thread(target=read)
t.start()
with phase("train_step"):
  for _ in range(30):
    y = f(x)  # dispatched; XLA computes on its own threads
y.block_until_ready()
t.join()
spin(0.2)  # outside any phase: other
cpu_profile.write()
"""


def test_phases_compilation_and_rest_add_up(tmp_path):
  out = tmp_path / "profile"
  env = {**os.environ, cpu_profile.ENV: str(out), "JAX_PLATFORMS": "cpu"}
  subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, check=True, timeout=120)
  (path,) = out.glob("trainer-*.json")
  p = json.loads(path.read_text())
  cpu = p["cpu_s"]
  assert 0.28 <= cpu["controller"] <= 0.45
  assert 0.13 <= cpu["store_read"] <= 0.3
  assert cpu["startup"] > 0.5  # imports, the compilation and the first spin
  assert 0.18 <= cpu["other"] <= 0.4
  assert cpu["train_step"] > 0.1  # the matmuls, dispatched here, computed on XLA's threads
  assert sum(cpu.values()) == pytest.approx(p["total_cpu_s"], abs=0.05)

  report = cpu_profile.summarize(str(out), trajectories=100, wall_s=10.0, cores=2)
  per = report["ms_per_trajectory"]
  assert per["controller"] == pytest.approx(1e3 * cpu["controller"] / 100)
  assert per["idle"] == pytest.approx(1e3 * (20.0 - sum(cpu.values())) / 100)
  assert "controller" in cpu_profile.table(report)


def test_off_without_the_variable_and_clear_errors(tmp_path, monkeypatch):
  monkeypatch.delenv(cpu_profile.ENV, raising=False)
  cpu_profile.start("trainer", compute_phase="train_step")
  assert not cpu_profile.enabled()
  with cpu_profile.phase("controller"):  # a no-op
    pass
  with pytest.raises(FileNotFoundError, match="no process profiles"):
    cpu_profile.summarize(str(tmp_path), 10, 1.0, 2)
  (tmp_path / "w-1.json").write_text(json.dumps({"role": "w", "cpu_s": {"engine": 1.0}}))
  with pytest.raises(ValueError, match="trajectories = 0"):
    cpu_profile.summarize(str(tmp_path), 0, 1.0, 2)
