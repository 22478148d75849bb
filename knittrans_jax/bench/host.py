"""What a benchmark's JSON records about the machine it ran on (cores, memory, /dev/shm)."""
from __future__ import annotations

import os
import platform
import shutil


def machine() -> dict:
  shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
  mem = None
  try:
    with open("/proc/meminfo") as f:
      mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
  except (OSError, StopIteration):
    pass
  return {"nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
          "memory_bytes": mem, "platform": platform.platform(),
          "dev_shm": None if shm is None else {"total_bytes": shm.total, "free_bytes": shm.free}}
