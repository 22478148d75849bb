"""The store, the fault scenarios and the job on s3://, against a local moto server
(knittrans_jax/testing/s3_server.py) reached through the standard AWS variables."""
import argparse
import dataclasses
import json
import re
import socket
import subprocess
import sys

import boto3
import numpy as np
import pytest
from store_helpers import SOURCES, check_payload, group

from knittrans_jax import gin_cli
from knittrans_jax.faults import (concurrent_writers, corrupt_chunk, reclaim_kill, s3_outage,
                                  trainer_kill, writer_kill)
from knittrans_jax.storage import Image, StoreError, StoreSchema, TrajectoryStore, unit_writer
from knittrans_jax.storage import layout as L
from knittrans_jax.testing.s3_server import start_s3_server

BUCKET, SEED, N = "knittrans-test", 5, 4


def _setup():
  """The run's set-up from the parsed gin config, built as launch.py builds it."""
  from knittrans_jax.job.config import JobConfig
  from knittrans_jax.job.setup import job_setup
  return job_setup(JobConfig())


@pytest.fixture(scope="module")
def s3():
  with start_s3_server() as server, pytest.MonkeyPatch.context() as mp:
    server.create_bucket(BUCKET)
    for key, value in server.env.items():  # inherited by every process a test starts
      mp.setenv(key, value)
    mp.delenv("AWS_ENDPOINT_URL", raising=False)
    yield server


@pytest.fixture
def s3_url(s3, request):
  return f"s3://{BUCKET}/{re.sub(r'[^A-Za-z0-9_-]', '_', request.node.name)}"


def _clean(out):
  assert out.lost == 0 and out.duplicated == 0, out.as_dict()
  assert out.written > 0 and out.trials > 0, out.as_dict()


def test_s3_urls_become_kvstore_specs_from_the_aws_variables(monkeypatch):
  for key in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
              "AWS_MAX_ATTEMPTS"):
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://10.0.0.7:9000")
  assert L.kvstore("s3://bkt/runs/a/") == {"driver": "s3", "bucket": "bkt", "path": "runs/a/",
                                           "endpoint": "http://10.0.0.7:9000",
                                           "aws_region": "us-east-1"}
  monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
  monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
  monkeypatch.setenv("AWS_REGION", "eu-west-1")
  monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
  assert L.kvstore("s3://bkt") == {"driver": "s3", "bucket": "bkt", "path": "",
                                   "aws_region": "eu-west-1",
                                   "aws_credentials": {"type": "environment"},
                                   "s3_request_retries": {"max_retries": 3}}
  assert L.kvstore("file:///tmp/x/") == "file:///tmp/x/"
  with pytest.raises(ValueError, match="needs a bucket"):
    L.kvstore("s3:///path")
  monkeypatch.setenv("AWS_MAX_ATTEMPTS", "zero")
  with pytest.raises(ValueError, match="AWS_MAX_ATTEMPTS='zero'"):
    L.kvstore("s3://bkt/p/")


def test_s3_server_that_cannot_start_says_why():
  with socket.create_server(("127.0.0.1", 0)) as busy:
    with pytest.raises(RuntimeError, match=r"exited with code 1; its log ends:\n.*in use"):
      start_s3_server(port=busy.getsockname()[1])


@pytest.mark.parametrize("dedup", [True, False])
def test_store_on_s3_create_append_list_read(s3, s3_url, dedup):
  schema = StoreSchema(sources=SOURCES, max_response_len=512, token_chunk=512, row_chunk=8,
                       image_chunk_bytes=768, dedup_images=dedup)
  rng = np.random.default_rng(SEED)
  images = [Image.of(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)) for _ in range(6)]
  store = TrajectoryStore.create(s3_url, schema)
  for u in range(2):
    w = store.writer(f"w{u}")
    for g in range(3 * u, 3 * u + 3):  # one image per group, shown by its N trajectories
      trajs = [dataclasses.replace(t, image_ids=(images[g].id,)) for t in group(SEED, g, N)]
      w.append(trajs, images=[images[g]])
  reopened = TrajectoryStore.open(s3_url)  # by URL alone, as another process would
  assert reopened.schema == schema and reopened.units() == ["w0", "w1"]
  metas = reopened.list_committed()
  assert sorted((m.group_id, m.index_in_group) for m in metas) == [
      (g, i) for g in range(6) for i in range(N)]
  payload = reopened.read(metas).result()
  check_payload(payload, SEED, N)
  for m in metas:
    np.testing.assert_array_equal(payload.images[m.image_ids[0]], images[m.group_id].array)
  # Each image stored once per unit with dedup, once per reference without.
  assert len(reopened.reader("w0").image_ids()) == (3 if dedup else 3 * N)
  # The objects are on the S3 server, under the URL's prefix.
  client = boto3.client("s3", endpoint_url=s3.endpoint)
  prefix = s3_url[len(f"s3://{BUCKET}/"):] + "/"
  keys = {o["Key"][len(prefix):] for o in client.list_objects_v2(
      Bucket=BUCKET, Prefix=prefix, MaxKeys=1000)["Contents"]}
  assert {"store.json", "_units/w0", "_units/w1", "w0/commit/c/0", "w1/sequences/c/0"} <= keys


def test_writer_sigkilled_mid_append_on_s3_with_a_polling_reader(s3_url, tmp_path):
  out = writer_kill.run(str(tmp_path), trials=8, store_url=s3_url)
  _clean(out)
  assert out.trials == 8 and out.trained == out.written and not out.errors, out.errors


def test_s3_outage_mid_append_fails_cleanly_and_recovers(s3_url, tmp_path):
  out = s3_outage.run(str(tmp_path), trials=1, store_url=s3_url)
  _clean(out)
  assert out.trained == out.written
  assert all("no append failed" not in e and "differ" not in e and "no recovery" not in e
             for e in out.errors), out.errors
  assert all(f"append to unit 'w0' failed" in e for e in out.errors), out.errors


def test_corrupt_object_on_s3_quarantines_the_unit(s3_url, tmp_path):
  out = corrupt_chunk.run(str(tmp_path), trials=2, groups=8, store_url=s3_url)
  _clean(out)
  assert 0 < out.quarantined < out.written and out.trained + out.quarantined == out.written
  assert all("is corrupt or truncated" in e for e in out.errors), out.errors


def test_concurrent_writers_on_s3(s3_url, tmp_path):
  out = concurrent_writers.run(str(tmp_path), writers=3, seconds=2.0, store_url=s3_url)
  _clean(out)
  assert out.trained == out.written and not out.errors, out.errors


def test_writer_killed_while_reclaiming_on_s3(s3_url, tmp_path):
  """Reclamation deletes the chunk objects below the floors (no free pool on s3)."""
  out = reclaim_kill.run(str(tmp_path), trials=2, store_url=s3_url)
  _clean(out)
  assert out.trained == out.written
  assert not any("left behind" in e or "was read" in e for e in out.errors), out.errors


@pytest.mark.slow
def test_job_on_s3_trainer_killed_then_resumed(s3_url, tmp_path):
  """The tiny text job with its store on s3: its rollout workers and the resumed
  trainer reach the store by URL; every trajectory is trained once, nothing lost."""
  out = trainer_kill.run(str(tmp_path), trials=1, train_batches=3, store_url=s3_url)
  _clean(out)
  assert not any("failed" in e or "expected" in e or "ended before" in e for e in out.errors), \
      out.errors
  assert out.trained == 3 * 2 * 16  # configs/text_grpo_test.gin: 2 mini-batches of 16


def test_bench_store_measures_s3_beside_file(tmp_path):
  out = tmp_path / "bench.json"
  proc = subprocess.run([sys.executable, "scripts/bench_store.py", "--json", str(out), "--mib", "1",
                         "--reps", "1", "--micro_reps", "3", "--s3", "--image_groups", "2",
                         "--image_n", "2", "--image_shape", "8,8,3", "--read_trajectories", "2",
                         "--image_reps", "1"], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["s3"]["trajectories"] == result["trajectories"]  # the same bytes on both
  for key in ("write_MBps", "read_MBps", "microbatch_read_MBps"):
    assert result[f"s3_vs_file_{key}"] == pytest.approx(result["s3"][key] / result[key])
  assert "s3 (moto)" in proc.stdout


def test_a_new_run_refuses_a_store_url_that_holds_a_previous_run(s3_url, tmp_path):
  """The work dir check does not see a store on s3 (it outlives --overwrite)."""
  from knittrans_jax.job.local import build_local
  TrajectoryStore.create(s3_url, StoreSchema(sources=("nearest",)))
  work = tmp_path / "run"
  gin_cli.parse(argparse.Namespace(gin_file=["configs/text_grpo_test.gin"], workdir=str(work),
                                   gin_bindings=[f"JobConfig.store_url = '{s3_url}'"]))
  with pytest.raises(ValueError, match="holds a previous run's store: pass --resume"):
    build_local(_setup(), str(work))


def test_a_commit_marker_write_with_a_lost_answer_is_resolved_from_the_store(monkeypatch):
  """On a remote store a marker PUT can land with its answer lost. The writer asks the
  store: landed is success; unknown is an error saying so, and the next append
  continues after whatever landed, never over rows a reader may have seen."""
  store = TrajectoryStore.create("memory://lost_answer/", StoreSchema(sources=SOURCES))
  w = store.writer("w0")
  w.append(group(SEED, 0, N))
  real_write, real_read = unit_writer.write_commit, unit_writer.read_commit

  def write_then_fail(array, commit, local_dir=None, in_place=False):
    real_write(array, commit, local_dir, in_place)
    raise OSError("connection reset after the PUT")

  monkeypatch.setattr(unit_writer, "write_commit", write_then_fail)
  assert len(w.append(group(SEED, 1, N))) == N  # it landed: the append succeeded
  reads = []

  def read_fails_once(*args, **kw):
    reads.append(1)
    if len(reads) == 1:
      raise OSError("server unreachable")
    return real_read(*args, **kw)

  monkeypatch.setattr(unit_writer, "read_commit", read_fails_once)
  with pytest.raises(StoreError, match="all of the append or none of it was committed"):
    w.append(group(SEED, 2, N))  # landed, but the writer cannot know
  monkeypatch.setattr(unit_writer, "write_commit", real_write)
  w.append(group(SEED, 3, N))  # re-reads the marker first: goes on after group 2
  metas = TrajectoryStore.open("memory://lost_answer/").list_committed()
  assert [m.group_id for m in metas] == [g for g in range(4) for _ in range(N)]
  check_payload(store.read(metas).result(), SEED, N)
