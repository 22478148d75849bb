"""The persistent compilation cache a job's processes share, and a lock per shape.

A job's rollout workers run the same sampler on the same shapes. With JAX's
persistent compilation cache every process can load what another compiled, but only
once it is written: workers that meet a new shape together compile it together (the
default job's two workers compiled `_generate` 8 times for 4 shapes, 2.6 s each on
2 cores, docs/rollout.md). `compiling(key)` makes the first process to meet a shape
compile it while the others wait on a file lock, then load it from the cache.

`enable(path)` sets the cache for this process and, through the environment, for
the processes it starts (local workers inherit it; Ray's runtime env passes it on,
cluster/ray_setup.py). A cache directory the environment names already
(JAX_COMPILATION_CACHE_DIR, as `make test` sets) wins over the configured one.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os

import jax

ENV = "JAX_COMPILATION_CACHE_DIR"
_MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def enable(path: str | None) -> str | None:
  """Turns the persistent compilation cache on at `path` (None: leaves JAX as it is)
  for this process and its children, every compilation cached (a tiny model's take
  under JAX's default 1 s threshold, and each is paid once per process without it).
  Returns the directory in use, or None."""
  chosen = os.environ.get(ENV) or (os.path.expanduser(path) if path else None)
  if chosen is None:
    return None
  os.environ[ENV] = chosen
  os.environ.setdefault(_MIN_TIME_ENV, "0")
  jax.config.update("jax_compilation_cache_dir", chosen)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ[_MIN_TIME_ENV]))
  return chosen


def directory() -> str | None:
  """The local directory of this process's compilation cache, if it has one."""
  path = jax.config.jax_compilation_cache_dir or os.environ.get(ENV)
  if not path or "://" in path:  # a remote cache: no file lock to share
    return None
  return path


def shape_key(*parts) -> str:
  """A lock name for a computation and its shape, from anything with a stable repr."""
  return hashlib.sha1(repr(parts).encode()).hexdigest()[:20]


@contextlib.contextmanager
def compiling(key: str):
  """Holds the cache's lock for `key` (no-op without a local cache): the process that
  gets it first compiles and writes the cache entry; the others then load it. The
  lock is released when the block ends or the process dies (flock)."""
  path = directory()
  if path is None:
    yield
    return
  locks = os.path.join(path, "knittrans-locks")
  os.makedirs(locks, exist_ok=True)
  with open(os.path.join(locks, key + ".lock"), "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)
