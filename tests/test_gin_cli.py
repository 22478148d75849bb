import argparse

import gin
import pytest

from knittrans_jax import gin_cli
from knittrans_jax.storage import StoreSchema


def _args(argv):
  parser = argparse.ArgumentParser()
  gin_cli.add_flags(parser)
  return parser.parse_args(argv)


def test_files_bindings_and_operative_config(tmp_path):
  base = tmp_path / "base.gin"
  base.write_text("StoreSchema.max_response_len = 5\nStoreSchema.sources = ('x',)\n")
  extra = tmp_path / "extra.gin"
  extra.write_text("StoreSchema.max_response_len = 77\n")
  workdir = tmp_path / "run"
  args = _args(["--gin_file", str(base), "--gin_file", str(extra),
                "--gin_bindings", "StoreSchema.sources = ('a', 'b')", "--workdir", str(workdir)])
  gin_cli.parse(args)
  schema = StoreSchema()
  assert schema.sources == ("a", "b") and schema.max_response_len == 77  # later wins
  assert "max_response_len = 77" in (workdir / "config.gin").read_text()
  path = gin_cli.save_operative_config(str(workdir))
  text = open(path).read()
  assert "StoreSchema.sources = ('a', 'b')" in text and "token_chunk" in text


def test_gin_files_resolve_from_the_repo_root(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # scripts may run from anywhere
  assert gin_cli._resolve("configs/store_demo.gin").endswith("configs/store_demo.gin")


def test_missing_gin_file_is_named():
  with pytest.raises(FileNotFoundError, match="nope.gin"):
    gin_cli.parse(_args(["--gin_file", "nope.gin"]))


def test_gin_state_is_clear_between_tests():
  assert StoreSchema().sources == ("math", "code", "chat")
  assert gin.config_str().strip() == ""
