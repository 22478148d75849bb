"""What the figure groups of scripts/reproduce_figures.py share: the repository root
and running a script to completion, its output in a log."""
from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_logged(cmd, log_path, what):
  """Runs a script to completion, its output to `log_path`; a failure names the log."""
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  with open(log_path, "w") as log:
    code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
  if code:
    with open(log_path) as f:
      tail = "".join(f.readlines()[-20:])
    raise RuntimeError(f"{what} failed (exit {code}); {log_path} ends:\n{tail}")
