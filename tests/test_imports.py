"""The package's import structure: every module imports on its own in a fresh process,
and the layers and no-cycle contracts in pyproject.toml ([tool.importlinter]) hold."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DRIVER = pathlib.Path(__file__).with_name("import_alone_proc.py")


def import_each(package: str, path: pathlib.Path, out: pathlib.Path, *flags: str) -> dict:
  subprocess.run([sys.executable, str(DRIVER), package, str(out), "--path", str(path), *flags],
                 check=True, timeout=540, cwd=path)
  return json.loads(out.read_text())


def write_package(root: pathlib.Path, files: dict[str, str]) -> None:
  for name, text in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(textwrap.dedent(text))


def test_every_module_imports_alone(tmp_path):
  """Each module in a child forked before any module of the package was imported:
  an import cycle that only works when something else is imported first fails here
  (a fresh `import knittrans_jax.rl` did, issue 42), as does a module that needs Ray,
  vLLM, torch or transformers at import time (tests/import_alone_proc.py BLOCKED)."""
  results = import_each("knittrans_jax", ROOT, tmp_path / "imports.json")
  files = [f.relative_to(ROOT).with_suffix("") for f in (ROOT / "knittrans_jax").rglob("*.py")
           if "__pycache__" not in f.parts]
  expected = {".".join(f.parts[:-1] if f.name == "__init__" else f.parts) for f in files}
  assert set(results) == expected
  failed = {name: r["error"] for name, r in results.items() if not r["ok"]}
  assert not failed, "modules that do not import on their own:\n\n" + "\n".join(
      f"{name}:\n{error}" for name, error in sorted(failed.items()))


def test_import_each_catches_what_only_an_order_hides(tmp_path):
  """The driver itself: `a` and `b` import each other (each fails alone, the error a
  fresh `import knittrans_jax.rl` gave), `c` needs Ray at import time, `d` defers it
  and `e` is fine."""
  write_package(tmp_path, {
      "pkg/__init__.py": "",
      "pkg/a.py": "from pkg.b import B\nA = 1\n",
      "pkg/b.py": "from pkg.a import A\nB = 2\n",
      "pkg/c.py": "import ray\n",
      "pkg/d.py": "def start():\n  import ray\n  return ray\n",
      "pkg/e.py": "import json\n",
  })
  r = import_each("pkg", tmp_path, tmp_path / "out.json", "--no-preload")
  assert sorted(r) == ["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e"]
  assert {n for n, v in r.items() if v["ok"]} == {"pkg", "pkg.d", "pkg.e"}
  assert "partially initialized module 'pkg.a'" in r["pkg.a"]["error"]
  assert "ray is not installed here" in r["pkg.c"]["error"]


def lint_imports(cwd: pathlib.Path) -> subprocess.CompletedProcess:
  exe = pathlib.Path(sys.executable).with_name("lint-imports")
  exe = str(exe) if exe.exists() else shutil.which("lint-imports")
  assert exe, "lint-imports is not installed (requirements-test.txt: import-linter)"
  # --no-cache: the graph from the files as they are now, not from a stale cache.
  return subprocess.run([exe, "--no-cache", "--no-logo"], cwd=cwd, capture_output=True,
                        text=True, timeout=120,
                        env={**os.environ, "PYTHONPATH": str(cwd)})


def test_layers_contract():
  """pyproject.toml's layers (a layer imports only layers below it) and no import cycle
  among the siblings of any package, function-level imports included."""
  r = lint_imports(ROOT)
  assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
  assert "layers KEPT" in r.stdout and "no cycles KEPT" in r.stdout, r.stdout[-4000:]


def test_lint_imports_counts_function_level_imports(tmp_path):
  """The layers contract sees an import inside a function (most of the upward imports
  issue 42 removed were deferred ones), so a deferred import cannot slip past it."""
  write_package(tmp_path, {
      "pyproject.toml": """\
          [tool.importlinter]
          root_package = "lay"
          [[tool.importlinter.contracts]]
          name = "layers"
          type = "layers"
          containers = ["lay"]
          layers = ["high", "low"]
          """,
      "lay/__init__.py": "",
      "lay/high.py": "from lay import low\n",
      "lay/low.py": "def later():\n  from lay import high\n  return high\n",
  })
  r = lint_imports(tmp_path)
  assert r.returncode != 0, r.stdout
  assert "lay.low -> lay.high (l.2)" in r.stdout, r.stdout
