"""The house's size limits (issue 62), measured on the tree: a module, the README and
the status page each stay readable in one sitting."""
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lines(path: str) -> int:
  with open(path) as f:
    return sum(1 for _ in f)


def over(pattern: str, limit: int) -> dict[str, int]:
  paths = glob.glob(os.path.join(ROOT, pattern), recursive=True)
  assert paths, pattern
  return {os.path.relpath(p, ROOT): n for p in paths if (n := lines(p)) > limit}


def test_no_package_module_over_450_lines():
  assert over("knittrans_jax/**/*.py", 450) == {}


def test_readme_and_status_fit_a_screen_or_two():
  assert over("README.md", 150) == {}
  assert over("docs/status.md", 120) == {}


def test_results_pages_are_dated():
  pages = glob.glob(os.path.join(ROOT, "docs", "results", "*.md"))
  assert pages
  for p in pages:
    name = os.path.basename(p)
    assert name[:4].isdigit() and name[4] == "-" and name[7] == "-" and name[10] == "-", name
