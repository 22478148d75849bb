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
