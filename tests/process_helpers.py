"""The processes of a running job, for tests that kill them."""
from __future__ import annotations

import psutil


def rollout_workers(pid: int) -> list[psutil.Process]:
  """The local rollout workers of the job process `pid`: the children of its fork
  server (job/workers.worker_context), which is one of the job's own children."""
  servers = [c for c in psutil.Process(pid).children()
             if "multiprocessing.forkserver" in " ".join(c.cmdline())]
  return [w for s in servers for w in s.children()]
