"""The job's TensorBoard event files (job/tb_events.py), read by TensorBoard itself."""
import math
import os

import pytest

from knittrans_jax.job.tb_events import ScalarWriter


def test_tensorboard_reads_every_scalar_back(tmp_path):
  event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  w = ScalarWriter(str(tmp_path), flush_every_s=3600.0)
  values = {"train/loss": [(1, 0.5), (2, -1.25), (300, 3e-8)],
            "reward/math 10": [(1, 0.0), (2**40, 1.0)],
            "eval/sampled": [(0, float("inf"))]}
  for tag, pts in values.items():
    for step, v in pts:
      w.add_scalar(tag, v, step)
  w.close()
  (name,) = os.listdir(tmp_path)
  assert name.startswith("events.out.tfevents.")
  acc = event_accumulator.EventAccumulator(str(tmp_path))
  acc.Reload()
  assert sorted(acc.Tags()["scalars"]) == sorted(values)
  for tag, pts in values.items():
    got = [(e.step, e.value) for e in acc.Scalars(tag)]
    assert [s for s, _ in got] == [s for s, _ in pts]
    for (_, v), (_, want) in zip(got, pts):  # stored as float32, as TensorBoard's own writer does
      assert v == want if math.isinf(want) else v == pytest.approx(want, rel=1e-7)


def test_a_record_cut_short_is_what_the_reader_drops(tmp_path):
  """A writer killed mid-record leaves a truncated last record: TensorBoard keeps every
  whole one before it (its reader checks each record's two crc32c)."""
  event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  w = ScalarWriter(str(tmp_path))
  for step in range(1, 6):
    w.add_scalar("train/loss", step / 10, step)
  w.close()
  data = open(w.path, "rb").read()
  open(w.path, "wb").write(data[:-7])
  acc = event_accumulator.EventAccumulator(str(tmp_path))
  acc.Reload()
  assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
