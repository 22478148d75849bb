"""A rollout worker on any host: joins a running job through its shared work dir.

  python scripts/rollout_worker.py --workdir /mnt/shared/run1

The job must run with JobConfig.control_address set (e.g. '0.0.0.0:0'); it writes
WORKDIR/control.json (address and key), which this worker reads. The worker gets
its own id and storage unit, the job's rollout settings (model, sampler, suite,
store URL), writes trajectories to the store by URL and picks up weights from
WORKDIR/weights. It exits when the job ends. See docs/distributed.md.
"""
from __future__ import annotations

import argparse
import os
import threading
import time


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="the job's work dir, as this host sees it")
  parser.add_argument("--timeout_s", type=float, default=300.0,
                      help="how long to wait for the job's control.json and its server")
  parser.add_argument("--name", default=None,
                      help="this worker's host, as the job's log and its unit's unit.json "
                      "name it (default: the hostname)")
  args = parser.parse_args()
  from knittrans_jax.rollout import remote
  from knittrans_jax.rollout.worker import worker_main

  w, job, requests, reports, stop = remote.connect(args.workdir, args.timeout_s, args.name)
  print(f"rollout worker {w}: connected; unit worker{w}", flush=True)
  done = threading.Event()

  def heartbeat():
    while not done.is_set():
      try:
        reports.put(("alive", w))
      except (OSError, EOFError):
        return  # the job is gone; the main loop notices too
      time.sleep(remote.HEARTBEAT_S)

  threading.Thread(target=heartbeat, daemon=True).start()
  store_url = job["store_url"]
  if job.get("store_in_workdir"):  # the default store: WORKDIR/store as this host mounts it
    store_url = "file://" + os.path.join(os.path.abspath(args.workdir), "store")
  try:
    worker_main(w, os.path.abspath(args.workdir), store_url, job["seed"], job["n"],
                job["model_config"], job["sampler_config"], requests, reports, stop,
                suite=job["suite"], vit_config=job["vit_config"], math=job.get("math"),
                max_groups_per_call=job.get("groups_per_call", 4), host=args.name,
                engine=job.get("engine", "jax"), engine_options=job.get("engine_options"))
  except (OSError, EOFError) as e:  # the controller went away mid-call
    print(f"rollout worker {w}: the job is gone ({e.__class__.__name__}); exiting", flush=True)
  finally:
    done.set()
  print(f"rollout worker {w}: done", flush=True)


if __name__ == "__main__":
  main()
