"""A script of scripts/ imported as a module (its functions tested in this process)."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str, module_name: str | None = None, register: bool = False):
  """scripts/NAME.py as a fresh module; its sibling scripts importable, as when run.
  `register`: put it in sys.modules first (a script whose dataclasses look it up)."""
  scripts = os.path.join(ROOT, "scripts")
  if scripts not in sys.path:
    sys.path.insert(0, scripts)
  spec = importlib.util.spec_from_file_location(module_name or name,
                                                os.path.join(scripts, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  if register:
    sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module
