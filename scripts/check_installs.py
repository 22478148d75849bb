"""Checks that `make install-gpu` and `make install-tpu` resolve, without installing:
a dry-run install of each target's requirement files into a throwaway venv, against
the package registries alone (this machine's wheel directory and caps dropped: a GPU
or TPU host has neither). Prints and writes the versions that matter.

  python scripts/check_installs.py --json runs/check_installs.json

Resolving is all it shows: nothing here has run on a GPU or a TPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Makefile's targets: the requirement files each installs, in its order.
TARGETS = {"gpu": ("requirements.txt", "requirements-vllm.txt", "requirements-ray.txt",
                   "requirements-gpu.txt"),
           "tpu": ("requirements.txt", "requirements-ray.txt", "requirements-tpu.txt")}
KEY = re.compile(r"^(jax|jaxlib|jax-cuda1\d-plugin|jax-cuda1\d-pjrt|libtpu|torch|vllm|"
                 r"nvidia-cuda-runtime-cu1\d|ray|numpy|flax|transformers)$")
UV = "uv==0.13.8"  # the Makefile's


def resolve(files: tuple[str, ...], python: str) -> dict[str, str]:
  """{package: version} of a dry-run install of `files` into `python`'s venv."""
  cmd = [python, os.path.join(ROOT, "scripts", "uv_install.py"), "--no_pip_config",
         "--dry-run"]
  for f in files:
    cmd += ["-r", os.path.join(ROOT, f)]
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
  if proc.returncode:
    raise SystemExit(f"{' '.join(files)} does not resolve (exit {proc.returncode}):\n"
                     f"{proc.stderr[-3000:]}")
  found = re.findall(r"^ \+ ([A-Za-z0-9_.-]+)==(\S+)$", proc.stdout + proc.stderr, re.M)
  if not found:
    raise SystemExit(f"no packages in uv's dry-run output:\n{proc.stderr[-2000:]}")
  return dict(found)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", default=None)
  parser.add_argument("--targets", default="gpu,tpu")
  args = parser.parse_args()
  out = {"date": time.strftime("%Y-%m-%d"), "targets": {}}
  with tempfile.TemporaryDirectory(prefix="check_installs_") as tmp:
    venv = os.path.join(tmp, "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    subprocess.run([python, "-m", "pip", "install", "-q", UV], check=True)
    for target in args.targets.split(","):
      if target not in TARGETS:
        raise SystemExit(f"--targets: unknown target {target!r}; known: {sorted(TARGETS)}")
      t0 = time.perf_counter()
      versions = resolve(TARGETS[target], python)
      key = {k: v for k, v in sorted(versions.items()) if KEY.match(k)}
      out["targets"][target] = {"files": list(TARGETS[target]), "packages": len(versions),
                                "key_versions": key, "resolve_s": time.perf_counter() - t0}
      print(f"make install-{target}: {len(versions)} packages resolve; "
            + ", ".join(f"{k} {v}" for k, v in key.items()))
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
