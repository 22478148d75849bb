"""metrics.jsonl's one reader: what it tolerates (a torn last line of a live or killed
run, when asked) and what it names (a garbled line, by file and line)."""
import json

import pytest

from knittrans_jax.admission import TrainBatchSpec
from knittrans_jax.job.metrics import MetricsLog, read_metrics


def _record(step):
  return {"step": step, "train_batch": (step - 1) // 2, "index": (step - 1) % 2,
          "source_counts": {"a": 2}, "trajectories": 4, "arch": [0, 1, 0, 1], "time_s": step}


def _write(path, lines):
  path.write_text("".join(line + "\n" for line in lines))


def test_reads_a_work_dir_or_the_file_and_skips_blank_lines(tmp_path):
  _write(tmp_path / "metrics.jsonl", [json.dumps(_record(1)), "", json.dumps(_record(2))])
  want = [_record(1), _record(2)]
  assert read_metrics(str(tmp_path)) == want
  assert read_metrics(str(tmp_path / "metrics.jsonl")) == want


def test_a_torn_last_line_is_left_out_only_when_partial(tmp_path):
  torn = json.dumps(_record(3))[:17]
  _write(tmp_path / "metrics.jsonl", [json.dumps(_record(1)), json.dumps(_record(2)), torn])
  assert [r["step"] for r in read_metrics(str(tmp_path), partial=True)] == [1, 2]
  with pytest.raises(ValueError, match=r"metrics.jsonl line 3 is not JSON"):
    read_metrics(str(tmp_path))


def test_a_garbled_line_before_the_last_is_named_even_when_partial(tmp_path):
  _write(tmp_path / "metrics.jsonl", [json.dumps(_record(1)), "", "{not json",
                                      json.dumps(_record(2))])
  with pytest.raises(ValueError, match=r"metrics.jsonl line 3 is not JSON .*'\{not json'"):
    read_metrics(str(tmp_path), partial=True)


def test_a_missing_file_is_no_records_only_when_partial(tmp_path):
  assert read_metrics(str(tmp_path), partial=True) == []
  with pytest.raises(FileNotFoundError):
    read_metrics(str(tmp_path))


def test_resume_keeps_the_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
  spec = TrainBatchSpec(group_size=2, groups_per_batch=2, num_mini_batches=1,
                        source_quota={"a": 2})
  _write(tmp_path / "metrics.jsonl", [json.dumps(_record(s)) for s in (1, 2, 3)]
         + [json.dumps(_record(4))[:30]])
  log = MetricsLog(str(tmp_path), spec, resume=True, upto_step=2)
  log.close()
  assert [r["step"] for r in log.records] == [1, 2] and log.trajectories == 8
  assert log.arch == [0, 1, 0, 1] * 2
  # The file is rewritten to what was kept, so a strict reader reads it whole.
  assert read_metrics(str(tmp_path)) == [_record(1), _record(2)]
