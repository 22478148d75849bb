"""The VLM job end to end: disaggregated on demand with the encode-once step, colocated
with the naive step; a damaged image chunk quarantined; a stochastic encoder refused.
The disaggregated run trains packed (JobConfig.packing). (tests/conftest.py runs this
file's tests on one worker: two share the vlm_run job.)"""
import os

import pytest
from test_job import KEEP_ROWS, check_trained, finish, start

from knittrans_jax.storage import TrajectoryStore

pytestmark = pytest.mark.slow


def check_vlm_run(work, mode):
  summary, recs = check_trained(work, 6)
  assert summary["mode"] == mode and summary["raw_transfer_s"] > 0
  # Each group's image is in its unit's image table once, shared by its 4 responses.
  store = TrajectoryStore.open("file://" + str(work / "store"))
  for unit in store.units():
    metas = store.list_committed(unit)
    groups = {m.group_id for m in metas}
    assert all(len(m.image_ids) == 1 for m in metas)
    assert len(store.reader(unit).image_ids()) == len({m.image_ids[0] for m in metas}) == len(groups)
  return recs


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
  """The VLM job disaggregated, on demand, with the encode-once step, packed (each
  segment its own image prefix)."""
  work = tmp_path_factory.mktemp("vlm") / "run"
  finish(start(work, "JobConfig.mode = 'disaggregated'", "JobConfig.data_path = 'ondemand'",
               "JobConfig.encode_once = True", "JobConfig.packing = True", KEEP_ROWS,
               gin_file="configs/vlm_grpo_test.gin"))
  return work


def test_vlm_end_to_end_encode_once(vlm_run):
  recs = check_vlm_run(vlm_run, "disaggregated")
  # Packed rows of 16 image + 8 text positions: one trajectory (at least 16 + 4) a row,
  # 2 micro-batches of 8 rows, the image positions counted as computed and filled.
  store = TrajectoryStore.open("file://" + str(vlm_run / "store"))
  metas = {m.id: m for m in store.list_committed()}
  for r in recs:
    filled = sum(metas[i].length + 16 for i in r["ids"])
    assert r["micro_batches"] == 2
    assert r["padding_fraction"] == pytest.approx(1 - filled / (2 * 8 * 24)), r


def test_vlm_colocated_naive_step_centralized(tmp_path):
  work = tmp_path / "run"
  finish(start(work, "JobConfig.mode = 'colocated'", "JobConfig.data_path = 'centralized'",
               "JobConfig.encode_once = False", KEEP_ROWS, gin_file="configs/vlm_grpo_test.gin"))
  check_vlm_run(work, "colocated")


def test_vlm_job_quarantines_a_damaged_image_chunk(vlm_run, tmp_path):
  """The run's mini-batches again through the job's trainer, after worker1's image
  data chunk is deleted: the unit is quarantined, its rows skip training (their
  loss tokens are counted in tokens_skipped), every step still runs."""
  import shutil

  import gin

  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.job.replay import replay
  from knittrans_jax.job.setup import job_setup
  run = tmp_path / "damaged"
  shutil.copytree(vlm_run, run)
  os.remove(run / "store" / "worker1" / "images" / "data" / "c" / "0")
  gin.parse_config_file(str(run / "config.gin"))
  job = replay(job_setup(JobConfig()), str(run), str(tmp_path / "replay"), consumers=1)
  recs = job.log.records
  assert len(recs) == 6
  store = TrajectoryStore.open(f"file://{run}/store")
  lost = [m for m in store.list_committed("worker1") if m.id in {i for r in recs for i in r["ids"]}]
  assert lost, "worker1 trained nothing in the run"
  assert set(job.quarantine.quarantined) == {"worker1"}
  assert sum(r["tokens_skipped"] for r in recs) == sum(m.response_len for m in lost)
  assert {m.id for m in lost} <= set(job.quarantine.bad_rows)
  assert all(r["loss"] == r["loss"] for r in recs)  # finite: no NaN from empty rows


def test_vlm_job_refuses_a_stochastic_encoder(tmp_path):
  proc = start(tmp_path / "run", "ViTConfig.dropout = 0.1", gin_file="configs/vlm_grpo_test.gin")
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode != 0 and "dropout with rate 0.1" in out, out[-2000:]
