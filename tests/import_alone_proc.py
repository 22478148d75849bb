"""Imports every module of a package, each in its own forked child of this fresh
interpreter (tests/test_imports.py).

    python tests/import_alone_proc.py PACKAGE OUT_JSON [--path DIR] [--jobs N] [--no-preload]

The parent imports only the standard library and the third-party packages named in
PRELOAD (so a child need not import jax again: the time goes to the package's own
modules), never a module of PACKAGE; each child then imports one module, so it runs
with no other module of the package imported before it, as `python -c "import M"`
would. The packages in BLOCKED (optional extras and test-only packages) raise
ImportError in a child: a module must defer them to import without them.
Writes {module: {"ok", "seconds", "error"}} to OUT_JSON.
"""
import argparse
import importlib
import importlib.util
import json
import os
import signal
import sys
import time
import traceback

# Third-party packages the package's modules import at module level (the slow ones:
# jax alone is some 2 s). Preloading them saves each child the time; a missing one
# is left for the child that needs it to fail on.
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.nnx", "flax.linen", "gin", "optax", "tensorstore",
           "orbax.checkpoint", "scipy.stats", "matplotlib", "tokenizers", "jinja2", "PIL.Image",
           "tqdm")
BLOCKED = ("ray", "vllm", "torch", "transformers")
CHILD_TIMEOUT_S = 120


class _Blocked:
  """A meta-path finder that refuses BLOCKED, as a machine without them would."""

  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in BLOCKED:
      raise ImportError(f"{name} is not installed here (import_alone_proc blocks "
                        f"{', '.join(BLOCKED)}: import it inside the function that needs it)")
    return None


def module_names(package: str) -> list[str]:
  """Every module and subpackage of `package`, from its files (importing none)."""
  spec = importlib.util.find_spec(package)
  root = list(spec.submodule_search_locations)[0]
  names = [package]
  for here, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
    rel = os.path.relpath(here, root)
    prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
    for f in sorted(files):
      if f.endswith(".py"):
        names.append(prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}")
  return sorted(set(names))


def child(package: str, name: str, out: str) -> None:
  signal.alarm(CHILD_TIMEOUT_S)
  t0 = time.perf_counter()
  try:
    before = sorted(m for m in sys.modules if m == package or m.startswith(package + "."))
    if before:
      raise AssertionError(f"not alone: {before} were imported before the fork")
    importlib.import_module(name)
    result = {"ok": True, "error": ""}
  except BaseException:  # noqa: B036 -- SystemExit at import is a failure too
    result = {"ok": False, "error": traceback.format_exc()}
  result["seconds"] = round(time.perf_counter() - t0, 3)
  with open(out, "w") as f:
    json.dump(result, f)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("package")
  ap.add_argument("out")
  ap.add_argument("--path", help="a directory to put first on sys.path")
  ap.add_argument("--jobs", type=int, default=min(8, len(os.sched_getaffinity(0))))
  ap.add_argument("--no-preload", action="store_true", help="import nothing before forking")
  a = ap.parse_args()
  if a.path:
    sys.path.insert(0, a.path)
  for m in () if a.no_preload else PRELOAD:
    try:
      importlib.import_module(m)
    except ImportError:
      pass
  sys.meta_path.insert(0, _Blocked())
  names = module_names(a.package)
  tmp = a.out + ".d"
  os.makedirs(tmp, exist_ok=True)
  running: dict[int, str] = {}
  results: dict[str, dict] = {}

  def reap():
    pid, status = os.wait()
    name = running.pop(pid)
    fn = os.path.join(tmp, name)
    if os.path.exists(fn):
      with open(fn) as f:
        results[name] = json.load(f)
    else:  # killed (the alarm, a crash) before it could write
      sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
      results[name] = {"ok": False, "seconds": None, "error": (
          f"the child died: exit status {status}" + (
              f", signal {sig}" + (f" (over {CHILD_TIMEOUT_S} s)" if sig == signal.SIGALRM
                                   else "") if sig else ""))}

  for name in names:
    while len(running) >= a.jobs:
      reap()
    pid = os.fork()
    if pid == 0:
      child(a.package, name, os.path.join(tmp, name))
    running[pid] = name
  while running:
    reap()
  with open(a.out, "w") as f:
    json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
  main()
