"""Weight sync (rollout/weights.py): shards written per process, assembled on the
worker's host; stale versions of a longer run removed on resume; pruning. Shared
memory: exact zero-copy round trip, the engine's dtype, release, damage named,
the fallback to files."""
import dataclasses
import errno
import fcntl
import os
import shutil
import subprocess

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rollout.weight_segment import PieceOut, SegmentError, read_segment, write_segment
from knittrans_jax.rollout.weight_subscriber import WeightSubscriber, WeightSyncError
from knittrans_jax.rollout.weights import WeightPublisher, WeightSyncConfig, wire_template
from knittrans_jax.train import MeshConfig, OptimizerConfig, init_train_state, make_mesh, make_optimizer

CFG = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64)


def fsdp_params():
  gin.clear_config()
  gin.parse_config_file("configs/mesh/fsdp.gin")
  mesh_cfg = MeshConfig()
  gin.clear_config()
  _, state, _ = init_train_state(lambda r: DecoderLM(CFG, r), make_optimizer(OptimizerConfig()),
                                 make_mesh(mesh_cfg), mesh_cfg.rules, 0)
  return state.params


def template(cfg=CFG):
  with nnx.use_eager_sharding(False):
    return nnx.split(DecoderLM(cfg, nnx.Rngs(1)), nnx.Param)[1]


def test_sharded_parts_assemble_to_the_full_parameters(tmp_path):
  params = fsdp_params()
  split = [x for x in jax.tree.leaves(params) if not x.is_fully_replicated]
  assert split, "the fsdp layout splits some parameters, so shards are really assembled"
  pub = WeightPublisher(str(tmp_path))
  pub.write_part(3, params)
  with pytest.raises(RuntimeError, match=r"parts \[1\] of 2 are missing"):
    pub.commit(3, parts=2)
  pub.commit(3, parts=1)
  sub = WeightSubscriber(str(tmp_path), template())
  version, got = sub.poll()
  assert version == 3 and sub.poll() is None
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_resume_removes_versions_of_the_longer_run_and_pruning_keeps_the_newest(tmp_path):
  params = template()
  first = WeightPublisher(str(tmp_path), keep=2)
  for v in range(6):
    first.write_part(v, params)
    first.commit(v)
  assert sorted(os.listdir(tmp_path / "weights")) == ["LATEST", "v00000004", "v00000005"]
  # Resumed from the checkpoint at version 3: 4 and 5 belong to the run that went on.
  again = WeightPublisher(str(tmp_path), keep=2, version=3)
  assert sorted(os.listdir(tmp_path / "weights")) == ["LATEST"]
  for v in (3, 4):
    again.write_part(v, params)
    again.commit(v)
  assert sorted(os.listdir(tmp_path / "weights")) == ["LATEST", "v00000003", "v00000004"]
  assert WeightSubscriber(str(tmp_path), params).poll()[0] == 4


# -- shared memory ('shm'): one segment per version, mapped by every subscriber ----------


def shm_publisher(tmp_path, spares=1, **kw):
  sync = WeightSyncConfig(transport="shm", shm_dir=str(tmp_path / "shm"), spare_segments=spares)
  os.makedirs(sync.shm_dir, exist_ok=True)
  return WeightPublisher(str(tmp_path / "work"), sync=sync, **kw)


def segments(tmp_path):
  return sorted(os.listdir(tmp_path / "shm"))


def test_shm_round_trip_is_exact_zero_copy_and_in_the_engine_dtype(tmp_path):
  params = fsdp_params()  # sharded over the 8 devices: the shards land in one segment
  pub = shm_publisher(tmp_path)
  pub.write_part(1, params)
  pub.commit(1)
  sub = WeightSubscriber(str(tmp_path / "work"), template())
  version, got = sub.poll()
  assert version == 1 and sub.poll() is None
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    assert not a.flags.owndata  # a view of the mapping, not a copy
    np.testing.assert_array_equal(a, np.asarray(b))
  # bf16 on the wire: the cast happens once, in the publisher.
  bf16 = shm_publisher(tmp_path, dtype="bfloat16")
  bf16.write_part(2, params)
  bf16.commit(2)
  sub = WeightSubscriber(str(tmp_path / "work"), wire_template(template(), "bfloat16"))
  _, got = sub.poll()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(a, np.asarray(b.astype(jnp.bfloat16)))
  # A subscriber expecting float32 is told which leaf and dtype disagree.
  with pytest.raises(WeightSyncError,
                     match=r"leaf .*kernel.*: dtype bfloat16, the model's float32"):
    WeightSubscriber(str(tmp_path / "work"), template()).poll()


def test_shm_release_unlinks_older_versions_held_mappings_stay_valid(tmp_path):
  params = template()
  pub = shm_publisher(tmp_path, spares=0, version=0)
  sub = WeightSubscriber(str(tmp_path / "work"), params)
  pub.write_part(0, params)
  pub.commit(0)
  _, held = sub.poll()  # an engine holding v0
  shifted = jax.tree.map(lambda x: x + 1, params)
  for v in (1, 2):
    pub.write_part(v, shifted)
    pub.commit(v)
  assert len(segments(tmp_path)) == 1 and segments(tmp_path)[0].endswith("v00000002-p0")
  for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(params)):  # unlinked, still mapped
    np.testing.assert_array_equal(a, np.asarray(b))
  assert sub.poll()[0] == 2
  # A trainer killed mid-write leaves a temporary file and its newest version: the next
  # trainer to start in the work dir unlinks both, and on the host whatever a dead
  # writer left; one that finishes unlinks its own.
  dead = subprocess.Popen(["true"])
  dead.wait()
  shm = tmp_path / "shm"
  open(shm / (segments(tmp_path)[0] + ".tmp123"), "wb").close()
  open(shm / f"knittrans-0123456789ab-{dead.pid}-v00000001-p0", "wb").close()
  live = f"knittrans-0123456789ab-{os.getpid()}-v00000001-p0"
  open(shm / live, "wb").close()
  again = shm_publisher(tmp_path, spares=0, version=1)
  assert segments(tmp_path) == [live]
  os.unlink(shm / live)
  assert WeightSubscriber(str(tmp_path / "work"), params).poll() is None
  again.write_part(2, params)
  again.commit(2)
  again.close()
  assert segments(tmp_path) == [] and not (tmp_path / "work" / "weights" / "LATEST").exists()


def test_shm_spares_are_reused_only_once_no_reader_maps_them(tmp_path):
  params = template()
  plus = lambda k: jax.tree.map(lambda x: x + k, params)  # noqa: E731
  pub = shm_publisher(tmp_path, version=0)
  sub = WeightSubscriber(str(tmp_path / "work"), params)
  for v in (0, 1):
    pub.write_part(v, plus(v))
    pub.commit(v)
    if v == 0:
      _, held = sub.poll()  # an engine holding v0
  pub.write_part(2, plus(2))  # v0 retired to a spare, but mapped: a new file
  pub.commit(2)
  assert pub.pool.reused == 0
  assert [n.rsplit("-", 2)[1] for n in segments(tmp_path)] == ["spare0", "v00000001",
                                                                "v00000002"]
  for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))  # still v0's values
  del held, a
  pub.write_part(3, plus(3))  # v1 retired; v0's file unmapped now: written into
  pub.commit(3)
  assert pub.pool.reused == 1
  assert [n.rsplit("-", 2)[1] for n in segments(tmp_path)] == ["spare1", "v00000002",
                                                                "v00000003"]
  v, got = sub.poll()
  assert v == 3
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plus(3))):
    np.testing.assert_array_equal(a, np.asarray(b))
  # A reader that opened a name the writer has since retired and is overwriting (its
  # exclusive lock) is told the segment is gone, as for an unlinked one.
  spare = str(tmp_path / "shm" / segments(tmp_path)[0])
  fd = os.open(spare, os.O_RDWR)
  fcntl.flock(fd, fcntl.LOCK_EX)
  with pytest.raises(FileNotFoundError, match="retired"):
    read_segment(spare)
  os.close(fd)
  del got, a
  for v in (4, 5, 6):  # the steady state: three files, each version written into a spare
    pub.write_part(v, plus(v))
    pub.commit(v)
  assert pub.pool.reused == 4 and len(segments(tmp_path)) == 3
  # An engine that holds on to every version: spares beyond the one kept are unlinked
  # (their memory stays with the engine), new files are written.
  kept = []
  for v in (7, 8, 9, 10):
    pub.write_part(v, plus(v))
    pub.commit(v)
    kept.append(sub.poll()[1])
  assert pub.pool.reused == 7 and len(segments(tmp_path)) == 3
  for a, b in zip(jax.tree.leaves(kept[0]), jax.tree.leaves(plus(7))):
    np.testing.assert_array_equal(a, np.asarray(b))
  pub.close()  # unlinks every segment and spare
  assert segments(tmp_path) == []
  with pytest.raises(ValueError, match=r"WeightSyncConfig.spare_segments = -1: an int >= 0"):
    WeightSyncConfig(spare_segments=-1)


def test_shm_damaged_truncated_missing_and_misshapen_segments_are_named(tmp_path):
  params = template()
  pub = shm_publisher(tmp_path)
  pub.write_part(4, params)
  pub.commit(4)
  path = str(tmp_path / "shm" / segments(tmp_path)[0])
  with open(path, "rb") as f:
    good = f.read()
  work = str(tmp_path / "work")

  def poll_with(data):
    with open(path, "wb") as f:
      f.write(data)
    return WeightSubscriber(work, params).poll()

  flipped = bytearray(good)
  flipped[-100] ^= 1
  with pytest.raises(SegmentError, match=r"data crc32c 0x\w+, stored 0x\w+ \(damaged\)"):
    poll_with(bytes(flipped))
  with pytest.raises(SegmentError, match=f"truncated: {len(good) - 7} bytes, its header says "
                     f"{len(good)}"):
    poll_with(good[:-7])
  with pytest.raises(SegmentError, match="magic"):
    poll_with(b"x" * len(good))
  os.unlink(path)
  with pytest.raises(WeightSyncError, match=r"weights v4: segment .*v00000004-p0.* is not there"):
    WeightSubscriber(work, params).poll()
  pub.write_part(5, params)
  pub.commit(5)
  wider = template(dataclasses.replace(CFG, width=16))
  with pytest.raises(WeightSyncError, match=r"leaf .*: a piece of shape \(\d+, 32\) .* does not "
                     r"fit the model's shape \(\d+, 16\)"):
    WeightSubscriber(work, wider).poll()


def test_shm_without_verify_stores_no_data_crc_and_still_checks_the_header(tmp_path):
  """WeightSyncConfig.verify = False: the publisher computes no data crc32c (a pass
  over the bytes), readers check none; the header's own crc is still checked."""
  params = template()
  sync = WeightSyncConfig(transport="shm", shm_dir=str(tmp_path / "shm"), verify=False)
  os.makedirs(sync.shm_dir)
  pub = WeightPublisher(str(tmp_path / "work"), sync=sync)
  for v in (1, 2, 3):  # the third is written into a spare (the pool's path)
    pub.write_part(v, params)
    pub.commit(v)
    path = str(tmp_path / "shm" / [n for n in segments(tmp_path) if f"-v{v:08d}-" in n][0])
    head, _ = read_segment(path)
    assert head["version"] == v and head["data_crc32c"] is None
    version, got = WeightSubscriber(str(tmp_path / "work"), params, verify=False).poll()
    assert version == v
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
      np.testing.assert_array_equal(a, np.asarray(b))
  assert pub.pool.reused >= 1
  with open(path, "r+b") as f:  # a flipped byte in the header's JSON
    f.seek(70)
    byte = f.read(1)
    f.seek(70)
    f.write(bytes([byte[0] ^ 1]))
  with pytest.raises(SegmentError, match=r"header crc32c 0x\w+, stored 0x\w+ \(damaged\)"):
    read_segment(path)


def test_shm_parts_of_several_processes_assemble(tmp_path):
  x = np.arange(24, dtype=np.float32).reshape(6, 4)
  pub = shm_publisher(tmp_path)
  for p, rows in enumerate([(0, 4), (4, 6)]):  # two processes' shards of one leaf
    piece = x[rows[0]:rows[1]]
    write_segment(pub._segment(7, p), 7, p, [PieceOut(
        0, "['w']", (rows, (0, 4)), piece.dtype, piece.shape,
        lambda dst, piece=piece: dst.__setitem__(..., piece))])
  with pytest.raises(RuntimeError, match=r"parts \[2\] of 3 are missing"):
    pub.commit(7, parts=3)
  pub.commit(7, parts=2)
  _, got = WeightSubscriber(str(tmp_path / "work"), {"w": x}).poll()
  np.testing.assert_array_equal(got["w"], x)


def test_transport_auto_falls_back_to_files_where_shared_memory_cannot_serve(tmp_path):
  auto = WeightSyncConfig(shm_dir=str(tmp_path))
  assert auto.resolve("local").transport == "shm"
  assert auto.resolve("ray").transport == "ray"  # one copy per node: tests/test_weight_objects.py
  room = shutil.disk_usage(tmp_path).free
  assert auto.resolve("local", nbytes=room).transport == "files"  # two versions do not fit
  gone = WeightSyncConfig(shm_dir=str(tmp_path / "no_shm"))
  assert gone.resolve("local").transport == "files"
  with pytest.raises(ValueError, match="transport = 'shm' with JobConfig.cluster = 'ray'"):
    WeightSyncConfig(transport="shm").resolve("ray")
  with pytest.raises(ValueError, match=r"WeightSyncConfig.transport = 'nfs'"):
    WeightSyncConfig(transport="nfs")
  # 'files' publishes as before, and a subscriber reads either transport.
  pub = WeightPublisher(str(tmp_path / "work"), sync=gone.resolve("local"))
  pub.write_part(0, template())
  pub.commit(0)
  assert sorted(os.listdir(tmp_path / "work" / "weights")) == ["LATEST", "v00000000"]
  assert WeightSubscriber(str(tmp_path / "work"), template()).poll()[0] == 0
  # A run resumed on 'files' after one on 'shm' forgets the old run's segments.
  shm_publisher(tmp_path).write_part(3, template())
  shm_publisher(tmp_path).commit(3)
  WeightPublisher(str(tmp_path / "work"), sync=gone.resolve("local"), version=0)
  assert WeightSubscriber(str(tmp_path / "work"), template()).poll() is None


def test_shm_without_room_is_a_named_error_and_leaves_no_file(tmp_path, monkeypatch):
  def full(fd, offset, size):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(os, "posix_fallocate", full)
  pub = shm_publisher(tmp_path)
  with pytest.raises(OSError, match=r"no room for \d+ bytes in .*shm .*transport = 'files'"):
    pub.write_part(0, template())
  assert segments(tmp_path) == []
