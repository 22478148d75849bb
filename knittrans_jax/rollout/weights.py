"""Weight sync: the trainers publish each version, rollout workers pick up the newest.

Transports (`WeightSyncConfig.transport`):
  'shm'    each trainer process writes its part of version v once into a shared-memory
           segment (rollout/weight_segment.py) in `shm_dir` (/dev/shm); every worker on
           the host maps it: no file read, no unpickling, and on CPU the engine's arrays
           alias the mapping (device_put copies nothing), so the host holds one copy
           of a version however many engines use it.
  'ray'    (JobConfig.cluster = 'ray') each trainer process puts its part of version v
           into Ray's object store once; a registry actor names the parts
           (rollout/weight_objects.py). Ray moves a version to each node once and every
           worker there maps that one copy (read-only numpy views, no unpickling).
  'files'  each trainer process writes `weights/v{v:08d}/part{p}.npz` in the work dir
           and each worker reads and assembles the parts. The fallback for what the
           others cannot serve: a local run on a host without a writable /dev/shm with
           room for two versions.
  'auto'   (default) 'ray' on a Ray cluster; for a local run (JobConfig.cluster =
           'local') 'shm' when `shm_dir` is a writable directory with room for two
           versions (a container's /dev/shm is often 64 MB), else 'files'.
Each part holds this process's shards (replica 0 of each, so every element is written
once across processes), or each whole leaf when the process holds all of it. Leaves are
published in the engine's dtype (`dtype` = 'engine': DecoderConfig.dtype, e.g.
bfloat16, half the bytes of float32 master weights; 'param': as trained).

When every part is in place, process 0 replaces `weights/LATEST` (the version; for 'shm'
also the segments' paths as JSON, for 'ray' the registry's name); files and segments
are written under a temporary name and renamed, so a reader never sees a partial one.

Release, 'files': versions beyond `keep` are removed. 'ray': the registry drops older
versions at each commit; Ray frees one when no engine holds an array of it. 'shm',
`spare_segments` = 0: committing version v unlinks every older segment. An engine still
mapping an older version keeps its pages (tmpfs frees a file's memory when its last
mapping goes): a version's memory is freed exactly when it has a newer one and no engine
holds it, and a worker killed by SIGKILL drops its mappings with its process.
`spare_segments` = k > 0 (default 1): each writer renames its segments LATEST no longer
names to spare names at its next write, and writes into a spare no engine maps
(weight_segment.SegmentPool: readers hold a shared flock while they map one); it keeps
at most k spares. The host then holds the versions engines map, the newest two and up to
k spares per writer. A reader that read LATEST just before a commit finds its segment
gone (or retired) and LATEST moved on: it takes the newer version at its next poll. A
trainer that finishes or aborts unlinks its segments. What a killed trainer leaves (its
newest versions, its spares) is unlinked by the next trainer to start on the host: names
are `knittrans-<hash of the work dir>-<writer pid>-v{v:08d}-p{p}` (spares
`-spare{n}-p{p}`), and a starting trainer unlinks every segment of its work dir and
every one whose writer is no longer alive.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import gin
import jax
import jax.numpy as jnp
import numpy as np

from knittrans_jax.rollout import weight_objects
from knittrans_jax.rollout.weight_segment import PieceOut, SegmentPool, write_segment

TRANSPORTS = ("auto", "shm", "files", "ray")
DTYPES = ("engine", "param")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class WeightSyncConfig:
  """How weights reach the rollout workers (module docstring). `verify`: subscribers
  check each segment's data crc32c (one pass over its bytes per worker and version);
  False: the publisher stores none either ('shm'), one pass less at each end (a
  segment's header crc, size and piece bounds are still checked).
  `spare_segments` ('shm'): retired segments each trainer process keeps, mapped, to
  write later versions into (no allocation, no page faults: most of a publish's cost);
  0 unlinks each one as soon as a newer version is committed."""
  transport: str = "auto"
  dtype: str = "engine"
  shm_dir: str = "/dev/shm"
  verify: bool = True
  spare_segments: int = 1

  def __post_init__(self):
    for name, allowed in (("transport", TRANSPORTS), ("dtype", DTYPES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"WeightSyncConfig.{name} = {getattr(self, name)!r}: one of {allowed}")
    if not isinstance(self.spare_segments, int) or self.spare_segments < 0:
      raise ValueError(f"WeightSyncConfig.spare_segments = {self.spare_segments!r}: an int >= 0")

  def resolve(self, cluster: str, nbytes: int = 0) -> WeightSyncConfig:
    """This config with 'auto' decided for a run on `cluster` (JobConfig.cluster) whose
    versions are `nbytes` each. Only the publisher needs it: subscribers read either."""
    if self.transport == "shm" and cluster != "local":
      raise ValueError(f"WeightSyncConfig.transport = 'shm' with JobConfig.cluster = "
                       f"{cluster!r}: trainer actors and rollout workers may be on different "
                       "hosts; use 'ray' (or 'auto')")
    if self.transport == "ray" and cluster != "ray":
      raise ValueError(f"WeightSyncConfig.transport = 'ray' with JobConfig.cluster = "
                       f"{cluster!r}: Ray's object store needs the Ray cluster; use 'shm' or "
                       "'files' (or 'auto')")
    if self.transport != "auto":
      return self
    if cluster == "ray":
      return dataclasses.replace(self, transport="ray")
    shm = (cluster == "local" and os.path.isdir(self.shm_dir) and os.access(self.shm_dir, os.W_OK)
           and shutil.disk_usage(self.shm_dir).free >= 2 * nbytes)  # new + the one engines hold
    return dataclasses.replace(self, transport="shm" if shm else "files")

  def wire_bytes(self, params, model_config) -> int:
    """The bytes of one published version of `params` (arrays or shapes)."""
    dtype = self.wire_dtype(model_config)
    return sum(int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize
               for x in jax.tree.leaves(wire_template(params, dtype)))

  def wire_dtype(self, model_config) -> str | None:
    """The dtype floating leaves are published in; None: as the trainer holds them."""
    return model_config.dtype if self.dtype == "engine" else None


def wire_template(template, dtype: str | None):
  """`template`'s leaves as ShapeDtypeStructs, floating ones in `dtype` (what a
  subscriber receives from a publisher casting to it)."""
  def spec(x):
    dt = jnp.dtype(x.dtype)
    if dtype is not None and jnp.issubdtype(dt, jnp.floating):
      dt = jnp.dtype(dtype)
    return jax.ShapeDtypeStruct(np.shape(x), dt)
  return jax.tree.map(spec, template)


def version_dir(root: str, version: int) -> str:
  return os.path.join(root, f"v{version:08d}")


def _versions(root: str) -> list[int]:
  return sorted(int(d[1:]) for d in os.listdir(root) if d.startswith("v") and d[1:].isdigit())


def _segment_tag(weights_dir: str) -> str:
  return hashlib.sha1(os.path.realpath(weights_dir).encode()).hexdigest()[:12]


def _parse_segment(name: str) -> tuple[str, int, int | None] | None:
  """(work dir tag, writer pid, version; None for a temporary file) of a segment's file
  name; None for a file that is not one."""
  parts = name.split("-")
  if len(parts) != 5 or parts[0] != "knittrans" or not parts[2].isdigit():
    return None
  v = parts[3][1:]
  return parts[1], int(parts[2]), int(v) if v.isdigit() and "." not in parts[4] else None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def read_latest(root: str) -> tuple[int, dict | None]:
  """(version, where it is: {'segments': paths} or {'ray': registry name}; None for
  'files'); (-1, None) before any publish."""
  try:
    with open(os.path.join(root, "LATEST")) as f:
      text = f.read().strip()
  except FileNotFoundError:
    return -1, None
  if text.startswith("{"):
    d = json.loads(text)
    return int(d.pop("version")), d
  return int(text or -1), None


def _write_latest(root: str, text: str) -> None:
  tmp = os.path.join(root, "LATEST.tmp")
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, os.path.join(root, "LATEST"))


def _pieces(params):
  """(leaf id, name, box, host array) for this process's replica-0 shards of each leaf:
  one piece per leaf the process holds whole (its shards gathered on the host)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for leaf_id, (path, leaf) in enumerate(flat):
    name, shape = jax.tree_util.keystr(path), np.shape(leaf)
    if not isinstance(leaf, jax.Array):  # a host array: all of it
      yield leaf_id, name, tuple((0, d) for d in shape), [((...,), leaf)]
      continue
    shards = [s for s in leaf.addressable_shards if s.replica_id == 0]
    if leaf.is_fully_addressable:
      yield leaf_id, name, tuple((0, d) for d in shape), [(s.index, s.data) for s in shards]
      continue
    for s in shards:
      box = tuple((sl.start or 0, d if sl.stop is None else sl.stop)
                  for sl, d in zip(s.index, shape))
      yield leaf_id, name, box, [((...,), s.data)]


def _host_pieces(params):
  """(leaf id, name, box, one host array) for each of this process's pieces."""
  for leaf_id, name, box, slabs in _pieces(params):
    if len(slabs) == 1:
      data = np.asarray(slabs[0][1])
    else:
      data = np.empty([b - a for a, b in box], slabs[0][1].dtype)
      for where, slab in slabs:
        data[where] = np.asarray(slab)
    yield leaf_id, name, box, data


class WeightPublisher:
  """`version`: the trainer's version at start. Process 0 removes versions above it,
  left by a run that went further before it stopped (resume starts from its last
  checkpoint): the next publish must not be pruned as the oldest; with 'shm' it
  unlinks every segment of this work dir and every one a dead writer left on the
  host. `sync`: a resolved
  WeightSyncConfig (None: 'files', leaves as held); `dtype`: the dtype floating leaves
  are published in (WeightSyncConfig.wire_dtype; None: as held). With 'ray', process 0
  without a `version` (the driver) creates the registry the trainers' publishers use."""

  def __init__(self, workdir: str, keep: int = 3, process: int = 0, version: int | None = None,
               sync: WeightSyncConfig | None = None, dtype: str | None = None):
    self.dir = os.path.join(workdir, "weights")
    os.makedirs(self.dir, exist_ok=True)
    self.keep, self.process, self.dtype = keep, process, dtype
    self.shm = sync is not None and sync.transport == "shm"
    self.checksum = sync is None or sync.verify  # no reader checks it: not computed
    if sync is not None and sync.transport == "auto":
      raise ValueError("WeightPublisher: WeightSyncConfig.transport = 'auto'; resolve() it first")
    self.shm_dir, self.tag = (sync.shm_dir, _segment_tag(self.dir)) if self.shm else (None, None)
    self.registry = None
    self.owns_registry = sync is not None and sync.transport == "ray" and process == 0 \
        and version is None
    if sync is not None and sync.transport == "ray":
      self.registry_name = weight_objects.registry_name(_segment_tag(self.dir))
      self.registry = weight_objects.registry(self.registry_name, create=self.owns_registry)
    self.pool = None
    if self.shm and sync.spare_segments > 0:
      self.pool = SegmentPool(sync.spare_segments, lambda n: os.path.join(
          self.shm_dir, f"knittrans-{self.tag}-{os.getpid()}-spare{n}-p{self.process}"))
    if process == 0 and version is not None:
      for v in _versions(self.dir):
        if v > version:
          shutil.rmtree(version_dir(self.dir, v), ignore_errors=True)
      self._drop_segments_pointer()  # a previous run's segments: gone, or going now
      if self.registry is not None:  # a previous trainer group's objects died with it
        import ray
        ray.get(self.registry.clear.remote())
      if self.shm:  # this work dir's leftovers, and what killed trainers left on the host
        self._unlink(lambda tag, pid, v: tag == self.tag or not _alive(pid))

  def _segment(self, version: int, part: int) -> str:
    return os.path.join(self.shm_dir, f"knittrans-{self.tag}-{os.getpid()}-v{version:08d}-p{part}")

  def _cast(self, leaf):
    if (self.dtype is None or leaf.dtype == jnp.dtype(self.dtype)
        or not jnp.issubdtype(leaf.dtype, jnp.floating)):
      return leaf  # nothing to convert: no copy
    return leaf.astype(self.dtype)  # on the devices: half the bytes cross to the host for bf16

  def write_part(self, version: int, params) -> str:
    """This process's shards of `params` (device arrays) at `version`."""
    params = jax.tree.map(self._cast, params)
    if self.shm:
      return self._write_segment(version, params)
    if self.registry is not None:
      weight_objects.put_part(self.registry, version, self.process, _host_pieces(params))
      return f"ray:{self.registry_name}/v{version}/p{self.process}"
    index, arrays = [], {}
    for leaf_id, _, box, data in _host_pieces(params):
      arrays[f"a{len(index)}"] = data
      index.append([leaf_id, [list(b) for b in box]])
    folder = version_dir(self.dir, version)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"part{self.process}.npz")
    tmp = path + ".tmp.npz"
    np.savez(tmp, index=np.array(json.dumps(index)), **arrays)
    os.replace(tmp, path)
    return path

  def _write_segment(self, version: int, params) -> str:
    pieces = []
    for leaf_id, name, box, slabs in _pieces(params):
      def fill(dst, slabs=slabs):
        for where, slab in slabs:
          dst[where] = np.asarray(slab)  # the device-to-host copy lands in the segment
      pieces.append(PieceOut(leaf_id, name, box, np.dtype(slabs[0][1].dtype),
                             tuple(b - a for a, b in box), fill))
    path = self._segment(version, self.process)
    if self.pool is None:
      write_segment(path, version, self.process, pieces, checksum=self.checksum)
      return path
    latest = read_latest(self.dir)[0]
    for old in self.pool.live():  # versions LATEST no longer names: spares from now on
      if _parse_segment(os.path.basename(old))[2] < latest:
        self.pool.retire(old)
    self.pool.write(path, version, self.process, pieces, checksum=self.checksum)
    return path

  def commit(self, version: int, parts: int = 1) -> None:
    """(process 0) Every part of `version` is written: make it the latest."""
    if self.registry is not None:
      import ray
      missing = ray.get(self.registry.commit.remote(version, parts))
      if missing:
        raise RuntimeError(f"weights v{version}: parts {missing} of {parts} are not in the "
                           f"registry {self.registry_name}")
      _write_latest(self.dir, json.dumps({"version": version, "ray": self.registry_name}))
      return
    if self.shm:
      # Each part's writer is a process of its own: find the parts by name.
      found = {}
      for name in os.listdir(self.shm_dir):
        seg = _parse_segment(name)
        if seg is not None and seg[0] == self.tag and seg[2] == version:
          found[int(name.rsplit("-p", 1)[1])] = os.path.join(self.shm_dir, name)
      missing = [p for p in range(parts) if p not in found]
      if missing:
        raise RuntimeError(f"weights v{version}: parts {missing} of {parts} are missing in "
                           f"{self.shm_dir} (knittrans-{self.tag}-*)")
      paths = [found[p] for p in range(parts)]
      _write_latest(self.dir, json.dumps({"version": version, "segments": paths}))
      if self.pool is None:  # else each writer retires its own into its pool
        self._unlink(lambda tag, pid, v: tag == self.tag and v is not None and v < version)
      return
    folder = version_dir(self.dir, version)
    missing = [p for p in range(parts) if not os.path.exists(os.path.join(folder, f"part{p}.npz"))]
    if missing:
      raise RuntimeError(f"weights v{version}: parts {missing} of {parts} are missing in {folder}")
    _write_latest(self.dir, str(version))
    older = [v for v in _versions(self.dir) if v <= version]
    for v in older[:-self.keep]:
      shutil.rmtree(version_dir(self.dir, v), ignore_errors=True)

  def _unlink(self, which) -> None:
    """Unlinks the segments for which `which(tag, writer pid, version or None)` holds."""
    for name in os.listdir(self.shm_dir):
      seg = _parse_segment(name)
      if seg is not None and which(*seg):
        try:
          os.unlink(os.path.join(self.shm_dir, name))
        except FileNotFoundError:  # another process was first
          pass

  def close(self) -> None:
    """'shm' (process 0): unlinks LATEST and every segment of this work dir (engines that
    map one keep it until they let go); 'ray', the registry's creator: ends the registry
    (its references, so Ray frees what no engine holds). A no-op for 'files'."""
    if self.pool is not None:
      self.pool.close()
    if self.owns_registry and self.registry is not None:  # its creator (the driver) ends it
      import ray
      ray.kill(self.registry, no_restart=True)
      self.registry = None
    if not self.shm or self.process != 0:
      return
    self._drop_segments_pointer()
    self._unlink(lambda tag, pid, v: tag == self.tag)

  def _drop_segments_pointer(self) -> None:
    """Removes LATEST if it names segments (before they go, so no reader is told to
    open one that is not there)."""
    if read_latest(self.dir)[1] is not None:  # segments or the registry: not files
      try:
        os.unlink(os.path.join(self.dir, "LATEST"))
      except FileNotFoundError:
        pass
