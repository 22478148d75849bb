"""The suite's Ray fixture kills what ray.shutdown() leaves of its session (conftest)."""
import os
import subprocess
import sys

from conftest import _kill_strays


def test_processes_of_the_session_are_killed_and_others_left(tmp_path):
  mine, other = str(tmp_path / "ray" / "auth_token"), str(tmp_path / "other" / "auth_token")
  sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
  procs = {token: subprocess.Popen(sleep, env=dict(os.environ, RAY_AUTH_TOKEN_PATH=token))
           for token in (mine, other, mine + "x")}
  try:
    assert _kill_strays(mine) == [procs[mine].pid]
    assert procs[mine].wait(timeout=10) == -9
    assert procs[other].poll() is None and procs[mine + "x"].poll() is None
  finally:
    for p in procs.values():
      p.kill()
      p.wait()
