"""The object-store analogue of a full disk: the S3 server becomes unreachable in the
middle of a writer's appends (every connection cut, new ones refused). The append
fails with a clear error once its retries are spent, no partial row becomes
visible, everything committed stays intact, and once the server is reachable again
the same writer appends again.

The writer reaches the server through a CutProxy; the checks read the server
directly. The endpoint is the one the store's s3:// URLs use (AWS_ENDPOINT_URL_S3
or AWS_ENDPOINT_URL); AWS_MAX_ATTEMPTS bounds the writer's retries.
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

from knittrans_jax.faults.accounting import Outcome, append_until_failure, check_store
from knittrans_jax.faults.data import SCHEMA, group
from knittrans_jax.storage import StoreError, TrajectoryStore
from knittrans_jax.storage import layout as L
from knittrans_jax.testing.cut_proxy import CutProxy


@contextlib.contextmanager
def _environ(**values):
  saved = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k)
      else:
        os.environ[k] = v


def run(root: str, trials: int = 2, seed: int = 17, n: int = 4, store_url: str | None = None,
        attempts: int = 2) -> Outcome:
  """`store_url`: an s3:// URL the trials' stores live under (`root` is unused: the
  signature is every scenario's)."""
  if not store_url or not store_url.startswith("s3://"):
    raise ValueError(f"s3_outage needs store_url = s3://bucket/path, not {store_url!r}")
  endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
  if not endpoint:
    raise ValueError("s3_outage needs the S3 server's endpoint in AWS_ENDPOINT_URL_S3 (the "
                     "proxy that cuts the link sits in front of it)")
  rng = np.random.default_rng(seed)
  out = Outcome("s3 server unreachable mid-append")
  for t in range(trials):
    url = L.join(store_url, f"trial{t}")
    with CutProxy(endpoint) as proxy:
      with _environ(AWS_ENDPOINT_URL_S3=proxy.endpoint, AWS_MAX_ATTEMPTS=str(attempts)):
        writer = TrajectoryStore.create(url, SCHEMA).writer("w0")  # opened through the proxy
      cut = threading.Timer(float(rng.uniform(0.2, 1.0)), proxy.cut)
      cut.start()
      acked, gid, failed = append_until_failure(writer, seed, n)
      cut.join()
      out.trials += 1
      if failed is None:
        out.errors.append(f"trial {t}: no append failed")
        continue
      out.errors.append(str(failed).splitlines()[0][:200])
      store = TrajectoryStore.open(url)  # straight to the server
      visible = {m.group_id for m in store.list_committed()}
      # The failed append's group may be visible only if the error said it may be.
      maybe = {gid} if "all of the append or none" in str(failed) else set()
      if not acked <= visible or not visible - acked <= maybe:
        out.errors.append(f"trial {t}: after the failure {sorted(visible ^ acked)} differ "
                          "from the acknowledged groups")
      proxy.restore()
      try:  # the same writer goes on (re-appending the failed group if it did not land)
        if gid not in visible:
          writer.append(group(seed, gid, n))
        writer.append(group(seed, gid + 1, n))
        acked |= {gid, gid + 1}
      except StoreError as e:
        out.errors.append(f"trial {t}: no recovery: {e}")
      result = check_store(store, seed, n, acked)
      for f in ("written", "trained", "lost", "duplicated"):
        setattr(out, f, getattr(out, f) + getattr(result, f))
  return out
