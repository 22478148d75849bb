"""What every script's main shares: the gin flags, gin parsing with every configurable
registered, and `--check_args`.

A gin file may bind any configurable of the package, but gin only knows the ones
whose modules were imported: a script that parsed a file binding `EvalConfig`
without importing `job/evaluation.py` stopped with "No configurable matching". So
scripts parse through `parse` here, which imports every module that registers one
first (tests/test_docs_commands.py checks the list against the package's sources).

`--check_args`: the script parses its flags and its gin config, builds and checks the
configs (every config class a binding names, and what the script derives from
them), then returns without running. tests/test_docs_commands.py runs every command
the README and docs/ show this way.

Only scripts and tests import this module (it imports the whole package); the
package's own modules use gin_cli.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib

import gin

from knittrans_jax import gin_cli

# Every module with a @gin.configurable, imported before a gin file is parsed.
CONFIGURABLE_MODULES = (
    "knittrans_jax.admission.dispatch",
    "knittrans_jax.admission.peers",
    "knittrans_jax.admission.spec",
    "knittrans_jax.cluster.ray_setup",
    "knittrans_jax.job.config",
    "knittrans_jax.job.evaluation",
    "knittrans_jax.mesh",
    "knittrans_jax.models.decoder",
    "knittrans_jax.models.vit",
    "knittrans_jax.multimodal.encode_once",
    "knittrans_jax.rl.losses",
    "knittrans_jax.rollout.agent_loop",
    "knittrans_jax.rollout.agentic_tasks",
    "knittrans_jax.rollout.math_tasks",
    "knittrans_jax.rollout.qwen_vision_tasks",
    "knittrans_jax.rollout.sampler",
    "knittrans_jax.rollout.vllm_engine",
    "knittrans_jax.rollout.vllm_server_engine",
    "knittrans_jax.rollout.weights",
    "knittrans_jax.sim.config",
    "knittrans_jax.storage.schema",
    "knittrans_jax.train.checkpoint",
    "knittrans_jax.train.optimizer",
)


def register_configurables() -> list:
  """Imports every module of CONFIGURABLE_MODULES; returns its configurable config
  classes (frozen dataclasses gin knows)."""
  classes = []
  for name in CONFIGURABLE_MODULES:
    module = importlib.import_module(name)
    for obj in vars(module).values():
      if (isinstance(obj, type) and dataclasses.is_dataclass(obj)
          and obj.__module__ == name and _configurable(obj)):
        classes.append(obj)
  return classes


def _configurable(cls) -> bool:
  try:
    gin.get_bindings(cls)
  except ValueError:  # "Could not find ... in the Gin registry"
    return False
  return True


def add_check_flag(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--check_args", action="store_true",
                      help="parse the flags and the gin config, build and check the configs, "
                           "then exit 0 without running (tests/test_docs_commands.py)")


def add_flags(parser: argparse.ArgumentParser, workdir_default: str | None = None) -> None:
  """--gin_file, --gin_bindings, --workdir (gin_cli) and --check_args."""
  gin_cli.add_flags(parser, workdir_default)
  add_check_flag(parser)


def parse(args: argparse.Namespace) -> None:
  """gin_cli.parse with every configurable registered. With --check_args nothing is
  written (no config.gin) and every config class a binding names is built, so a bad
  value fails here, naming its field."""
  classes = register_configurables()
  if not getattr(args, "check_args", False):
    gin_cli.parse(args)
    return
  gin_cli.parse(argparse.Namespace(gin_file=args.gin_file, gin_bindings=args.gin_bindings))
  for cls in classes:
    if gin.get_bindings(cls):
      cls()


def check_job() -> None:
  """The training job's set-up checks on the parsed gin config (model, sampler, loss,
  tasks and their lengths, checked together), with nothing started or written."""
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.job.setup import job_setup
  job_setup(JobConfig())


def check_only(args: argparse.Namespace) -> bool:
  """True (after saying so) when --check_args asked to stop once the configs are
  built; the script's main then returns."""
  if not getattr(args, "check_args", False):
    return False
  print("check_args: flags and configs parsed and checked; nothing run")
  return True
