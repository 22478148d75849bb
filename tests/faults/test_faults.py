"""Fault injection (runnable alone: pytest tests/faults). Each scenario repeats with
random timing; nothing committed may be lost or duplicated. scripts/fault_report.py
runs the same scenarios with the full trial counts."""
import pytest

from knittrans_jax.faults import (concurrent_writers, corrupt_chunk, disk_full, reclaim_kill,
                                  trainer_kill, writer_kill)

pytestmark = pytest.mark.slow


def _clean(outcome):
  assert outcome.lost == 0 and outcome.duplicated == 0, outcome.as_dict()
  assert outcome.written > 0 and outcome.trials > 0, outcome.as_dict()


def test_writer_sigkill_mid_write(tmp_path):
  out = writer_kill.run(str(tmp_path), trials=6)  # scripts/fault_report.py runs more
  _clean(out)
  assert out.trials == 6 and out.trained == out.written


def test_corrupt_chunk_quarantines_the_unit_and_keeps_the_rest(tmp_path):
  out = corrupt_chunk.run(str(tmp_path), trials=3)
  _clean(out)
  assert 0 < out.quarantined < out.written and out.trained + out.quarantined == out.written
  assert all("is corrupt or truncated" in e for e in out.errors), out.errors


def test_disk_full_fails_cleanly_and_recovers(tmp_path):
  out = disk_full.run(str(tmp_path), trials=1)
  _clean(out)
  assert out.trained == out.written
  assert any("nothing of it was committed" in e for e in out.errors), out.errors
  assert not any("never filled" in e or "no recovery" in e for e in out.errors), out.errors


def test_concurrent_writers(tmp_path):
  out = concurrent_writers.run(str(tmp_path), writers=4, seconds=3.0)  # twice the cores
  _clean(out)
  assert out.trained == out.written and not out.errors, out.errors


def test_trainer_sigkill_then_resume(tmp_path):
  out = trainer_kill.run(str(tmp_path), trials=1)
  _clean(out)
  assert not any("failed" in e or "expected" in e or "ended before" in e for e in out.errors), \
      out.errors


def test_writer_sigkill_while_reclaiming(tmp_path):
  out = reclaim_kill.run(str(tmp_path), trials=5)
  _clean(out)
  assert out.trained == out.written
  assert any("refused: below the watermark" in e for e in out.errors), out.errors
  assert not any("left behind" in e or "was read" in e for e in out.errors), out.errors
