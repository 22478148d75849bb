"""The fault scenarios' child processes may print more than a pipe buffer holds."""
import sys
import time

import pytest

from knittrans_jax.faults.accounting import DrainedProcess, acked_groups

# 20000 acks are ~190 KiB, three times the 64 KiB Linux pipe buffer: a parent that
# reads only after the child exits (as concurrent_writers did) waits forever.
CHATTY = "import sys\nfor g in range(20000): print(f'ack {g}', flush=True)\nprint('done')"


@pytest.mark.timeout(60)
def test_acks_beyond_a_pipe_buffer_are_drained_while_the_writer_runs():
  proc = DrainedProcess([sys.executable, "-c", CHATTY])
  proc.wait_for_line(timeout=30)
  while proc.poll() is None:  # the parent's polling loop, as in concurrent_writers.run
    time.sleep(0.01)
  stdout, stderr = proc.communicate(timeout=30)
  assert proc.returncode == 0, stderr
  assert len(stdout) > 2 * 65536
  assert acked_groups(stdout) == set(range(20000)) and stdout.endswith("done\n")


def test_a_child_that_ends_without_output_is_an_error():
  proc = DrainedProcess([sys.executable, "-c", "import sys; sys.exit('no acks')"])
  with pytest.raises(RuntimeError, match="ended without printing: no acks"):
    proc.wait_for_line(timeout=30)
  proc.communicate(timeout=30)
