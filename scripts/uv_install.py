"""`uv pip install ARGS` into this interpreter's venv, under pip's configuration.

The Makefile installs with uv, not pip: uv downloads, unpacks and byte-compiles in
parallel, about half pip's time for the suite's packages (docs/results/2026-12-07-tests.md). But uv
reads none of pip's settings, and a machine's pip configuration (pip.conf files,
PIP_* variables) may say where packages come from and how to reach them: a local
index, a wheel directory, a constraints file, a certificate bundle. This hands uv
those settings, as `pip config list` reports them, so both installers take the same
packages from the same places.

Usage (the Makefile's): .venv/bin/python scripts/uv_install.py -r requirements.txt
`--no_pip_config` drops where pip's settings say packages come from (indexes, wheel
directories, constraints; scripts/check_installs.py: what a GPU or TPU host without this
machine's wheel directory and caps would resolve).
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

# pip setting -> uv flag; list-valued ones hold whitespace-separated items, a flag each.
_LISTS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
          "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
# pip setting -> uv environment variable.
_ENV = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT",
        "default-timeout": "UV_HTTP_TIMEOUT"}
# pip's precedence for `pip install`: PIP_* variables over the [install] section over
# [global] (files already merged by `pip config list`).
_RANK = {":env:": 0, "install": 1, "global": 2}


def pip_settings(listing: str) -> dict[str, str]:
  """{pip setting: value} from `pip config list` output, the winning variant of each."""
  best: dict[str, tuple[int, str]] = {}
  for line in listing.splitlines():  # `variant.key=repr(value)` per line
    m = re.fullmatch(r"([^.=]+)\.([a-z-]+)=(.*)", line.strip())
    if not m or m.group(1) not in _RANK:
      continue
    rank, key, value = _RANK[m.group(1)], m.group(2), str(ast.literal_eval(m.group(3)))
    if key not in best or rank < best[key][0]:
      best[key] = (rank, value)
  return {k: v for k, (_, v) in best.items()}


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
  """(uv flags, environment variables) that say what `settings` says to pip."""
  flags = [f"--index-url={settings['index-url']}"] if "index-url" in settings else []
  for key, flag in _LISTS.items():
    flags += [f"{flag}={item}" for item in settings.get(key, "").split()]
  if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
    flags.append("--no-index")
  env = {var: settings[key] for key, var in _ENV.items() if key in settings}
  return flags, env


def main(argv: list[str]) -> int:
  uv = os.path.join(os.path.dirname(sys.executable), "uv")
  if not os.path.exists(uv):
    sys.exit(f"uv_install: no uv at {uv}; install it first ({sys.executable} -m pip install uv)")
  listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                           capture_output=True, text=True, check=True).stdout
  flags, env = uv_options(pip_settings(listing))
  if "--no_pip_config" in argv:  # the registries alone (certificate and timeout kept)
    argv = [a for a in argv if a != "--no_pip_config"]
    flags = []
  # pip picks the best version over all indexes and find-links together (the CPU
  # torch build on a wheel directory, say, over the index's CUDA one); so does this
  # strategy. PYTHONDONTWRITEBYTECODE machines would otherwise never get .pyc files.
  cmd = [uv, "pip", "install", "--python", sys.executable, "--index-strategy",
         "unsafe-best-match", "--compile-bytecode", *flags, *argv]
  return subprocess.run(cmd, env=dict(os.environ, **env)).returncode


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
