"""A peer framework's own venv (Tunix, TransferQueue), built once beside the project's
and never mixed with it: the peer's pins conflict with ours."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence


def venv_python(venv: str, stamp: str) -> str | None:
  """The venv's python if its install finished (the stamp file is there), else None."""
  py = os.path.join(venv, "bin", "python")
  return py if os.path.exists(os.path.join(venv, stamp)) else None


def ensure_venv(venv: str, stamp: str, building: str, installs: Sequence[Sequence[str]],
                check: str, stamp_text: Callable[[str], str],
                ready: Callable[[str], str]) -> str:
  """The venv's python, building the venv first when its stamp is missing: each of
  `installs` runs as the venv's python with those arguments, then `check` (python -c
  code) prints what was installed; its output becomes the stamp (`stamp_text`) and the
  closing message (`ready`). `building` is the opening message."""
  py = os.path.join(venv, "bin", "python")
  if venv_python(venv, stamp):
    return py
  print(building, file=sys.stderr, flush=True)
  if not os.path.exists(py):
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
  for argv in installs:
    subprocess.run([py, *argv], check=True)
  out = subprocess.run([py, "-c", check], check=True, capture_output=True, text=True).stdout
  with open(os.path.join(venv, stamp), "w") as f:
    f.write(stamp_text(out))
  print(ready(out), file=sys.stderr, flush=True)
  return py
