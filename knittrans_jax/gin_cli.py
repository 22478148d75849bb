"""gin plumbing every script uses: --gin_file, --gin_bindings, --workdir.

As in t5x, each run writes the config it parsed (`config.gin`) at start and the
operative config (what was actually used, defaults included) at the end.
"""
from __future__ import annotations

import argparse
import os
import pathlib

import gin

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def add_flags(parser: argparse.ArgumentParser, workdir_default: str | None = None) -> None:
  parser.add_argument("--gin_file", action="append", default=[],
                      help="gin config file (repeatable; later files override earlier)")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="gin binding, e.g. \"StoreSchema.sources = ('math',)\" (repeatable)")
  parser.add_argument("--workdir", default=workdir_default,
                      help="run directory: configs, metrics and outputs go here")


def _resolve(path: str) -> str:
  """Finds a gin file as given, or relative to the repository root."""
  for candidate in (pathlib.Path(path), REPO_ROOT / path):
    if candidate.is_file():
      return str(candidate)
  raise FileNotFoundError(f"--gin_file {path!r} not found (looked in . and {REPO_ROOT})")


def parse(args: argparse.Namespace) -> None:
  """Parses the gin files and bindings of `args`; writes config.gin to the workdir."""
  files = [_resolve(f) for f in args.gin_file]
  gin.add_config_file_search_path(str(REPO_ROOT))  # `include 'configs/...'` from anywhere
  gin.parse_config_files_and_bindings(files, args.gin_bindings, finalize_config=False)
  if getattr(args, "workdir", None):
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "config.gin"), "w") as f:
      f.write(gin.config_str())


def save_operative_config(workdir: str, name: str = "operative_config.gin") -> str:
  """Writes the operative config (every configurable actually called) to the workdir."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, name)
  with open(path, "w") as f:
    f.write(gin.operative_config_str())
  return path
