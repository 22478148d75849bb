import os
import sys

import gin
import pytest

# Make tests/ importable for helper modules and child-process scripts.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()

# Tests are deterministic: hypothesis draws the same examples on every run.
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("deterministic", derandomize=True, print_blob=True)
_hyp_settings.load_profile("deterministic")
