"""Side by side with TransferQueue 0.1.11: put, get and end to end on the same bytes.

  python scripts/bench_vs_transferqueue.py --json runs/bench_vs_transferqueue.json
  python scripts/bench_vs_transferqueue.py --json runs/bench_vs_tq_quick.json --quick

A benchmark, not a test. The payload is TransferQueue 0.1.11's benchmark payload:
--groups 32 groups x --n 8 trajectories a rep, each a --prompt_len 128 token prompt
shared by its group and a --response_len 512 token response (int32 ids, float32
log-probs, a loss mask, a float32 reward); `vlm` adds one float32 image of
--image_shape 448 x 448 x 3 per group, which every trajectory of the group uses
(617.7 MB of token ids, log-probs and images a rep with a copy per trajectory);
`text` is the same without images. --consumers 2 consumers read half each.

  TransferQueue   its own venv (--venv, built here when missing: TransferQueue
                  0.1.11 from the package index, torch 2.13.0 CPU as the project's
                  tests pin it, Ray 2.60.0). A local Ray (on the loopback alias
                  --node_address) runs TQ's controller with GRPOGroupNSampler(n) and
                  its SimpleStorage backend (2 storage units, in memory), as
                  tq.init sets them up. The producer (the worker's driver) puts the
                  rep as one TensorDict, a copy of the group's image in every
                  trajectory's row (TQ has no dedup), with `client.put(td,
                  partition_id)` into a fresh partition; each consumer (a Ray actor
                  with its own TQ client) calls `get_meta(fields, B / consumers,
                  partition, task_name='train')`, which hands each whole groups,
                  then `get_data(meta)`; the producer clears the partition
                  (`clear_partition`).
  ours            a TrajectoryStore on file:///dev/shm (--dir; tmpfs), one
                  long-lived unit a store (fresh rows every rep). The clear
                  (--our_clear): `retain` (default) raises the unit's low watermark
                  past the rep once both consumers hold it and the writer reclaims
                  its chunks (the job's retention, storage/retention.py: later reps
                  append into the recycled files); `unit` writes a fresh unit a rep
                  and deletes it; `none` keeps every rep. The
                  producer hashes each group's image once (Image.of) and appends
                  the rep in one `writer.append`; the metadata records it returns go
                  to the consumer processes (as the job's controller hands them out)
                  and each reads its half with `store.read(metas).result()`.
                  `dedup`: StoreSchema(dedup_images=True), each image stored and read
                  once; `equal_bytes`: dedup_images=False, a copy per trajectory
                  written and read, TQ's bytes.

What is timed, per rep, on each side (stores and servers stay up across reps, as in
a long-lived job; payload generation is not timed):
  put_s         the producer's put (ours: Image.of hashes + append; TQ: put)
  get_s         from the go to the consumers until both hold a trainer-ready batch:
                token ids [b, L], log-probs, and a contiguous image batch, one row a
                trajectory (TQ, and ours at equal bytes) or one a distinct image
                plus an index (ours with dedup). TQ: get_meta + get_data, then views
                of its jagged tensors' buffers (no copy); ours: the metadata records
                sent to the consumers + store.read + np.stack into the batch.
                get_api_s and batch_s split it (max over consumers).
  clear_s       TQ: clear_partition; ours: store.retain_from + writer.reclaim
                (--our_clear retain), deleting the rep's unit (unit), or 0 (none)
  end_to_end_s  put_s + get_s (end_to_end_with_clear_s adds clear_s)
After the timing each consumer checks every trajectory it read: a CRC32 over its
image, token ids and response log-probs, against the producer's (computed from the
generated arrays); any mismatch fails the run. Our store also checks every image copy
it reads against its content hash.

A warm-up rep (not counted), then --reps reps; TQ and ours alternate within each rep
and swap order between reps; medians of the reps. Ratios are TQ time / our time
(above 1: we are faster): text.end_to_end_ratio, vlm.dedup.end_to_end_ratio and
vlm.equal_bytes.end_to_end_ratio, the last at the same bytes on both sides.
The two sides run in separate processes with separate venvs (this script, run by
the project's venv, starts `--side tq` with the TQ venv's python and `--side ours`
with its own); they share only numpy and the harness in scripts/ (tq_payload.py: the
payload and its checks; line_worker.py: the worker loop). TQ's side is tq_side.py,
ours tq_ours_side.py.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time

from line_worker import Worker
from tq_payload import WORKLOAD_IDS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TQ_VERSION = "0.1.11"
# The TQ venv: torch pinned to the CPU build this machine's pip configuration serves
# (requirements-test.txt), Ray as requirements-ray.txt pins it. TransferQueue's own
# requirements name hydra-core (which would downgrade omegaconf) and Ray's extras:
# it is installed without them, with what it imports.
TQ_DEPS = ["torch==2.13.0", "ray==2.60.0", "numpy", "omegaconf", "pyzmq", "msgspec", "psutil",
           "prometheus_client>=0.20.0", "cloudpickle", "orjson", "importlib_metadata", "packaging"]
TQ_NODEPS = [f"transferqueue=={TQ_VERSION}", "tensordict==0.15.3", "pyvers==0.2.3"]


def ensure_tq_venv(venv):
  """The TransferQueue venv's python, building the venv first when missing."""
  from knittrans_jax.bench.venvs import ensure_venv
  pip = ["-m", "pip", "install", "-q"]
  return ensure_venv(
      venv, ".installed-tq",
      f"building the TransferQueue {TQ_VERSION} venv in {venv} (pip; a few minutes)...",
      [pip + TQ_DEPS, pip + ["--no-deps"] + TQ_NODEPS],
      "import torch, transfer_queue; assert torch.version.cuda is None, torch.__version__; "
      "print(torch.__version__)",
      stamp_text=lambda out: f"transferqueue=={TQ_VERSION} torch=={out.strip()}\n",
      ready=lambda out: f"TransferQueue venv ready (torch {out.strip()})")


def summarize(reps):
  keys = ("put_s", "get_s", "get_api_s", "batch_s", "clear_s", "end_to_end_s",
          "end_to_end_with_clear_s")
  return {"per_rep": {k: [r[k] for r in reps] for k in keys + ("put_bytes", "read_bytes")},
          "median": {k: statistics.median(r[k] for r in reps) for k in keys},
          "put_bytes": reps[0]["put_bytes"], "read_bytes": reps[0]["read_bytes"],
          "checked": sum(r["checked"] for r in reps)}


def ratios(tq, ours):
  out = {}
  for k in ("end_to_end_s", "put_s", "get_s", "get_api_s", "end_to_end_with_clear_s"):
    name = k[:-2] + "_ratio"
    out[name] = tq["median"][k] / ours["median"][k] if ours["median"][k] > 0 else None
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", required=True)
  p.add_argument("--workloads", default="text,vlm")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--groups", type=int, default=32)
  p.add_argument("--n", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=128)
  p.add_argument("--response_len", type=int, default=512)
  p.add_argument("--image_shape", default="448,448,3")
  p.add_argument("--consumers", type=int, default=2)
  p.add_argument("--dir", default="/dev/shm", help="our stores go in a fresh folder here")
  p.add_argument("--venv", default=os.path.join(ROOT, ".cache", "venv-tq"))
  p.add_argument("--our_clear", choices=("retain", "unit", "none"), default="retain",
                 help="retain: the consumed rep reclaimed by retention (the job's way); "
                      "unit: a fresh unit a rep, deleted after it; none: every rep kept")
  p.add_argument("--node_address", default="127.0.0.3",
                 help="TQ's Ray node address: a loopback alias (Ray replaces 127.0.0.1 with "
                      "the host's routable address)")
  p.add_argument("--ray_cpus", type=int, default=8,
                 help="logical CPUs for Ray's placement (controller, storage units, consumers)")
  p.add_argument("--tq_units", type=int, default=2, help="TQ SimpleStorage units")
  p.add_argument("--ours_src", default=ROOT,
                 help="the folder our side imports knittrans_jax from (another checkout, say)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--timeout", type=float, default=600, help="seconds for any one step")
  p.add_argument("--quick", action="store_true", help="tiny sizes, one rep: a smoke run")
  p.add_argument("--side", choices=("tq", "ours"), help=argparse.SUPPRESS)
  p.add_argument("--store_dir", help=argparse.SUPPRESS)
  p.add_argument("--ray_tmp", help=argparse.SUPPRESS)
  p.add_argument("--ray_token", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.quick:
    args.groups, args.n, args.prompt_len, args.response_len = 4, 8, 16, 48
    args.image_shape, args.reps = "32,32,3", 1
  args.image_shape = tuple(int(d) for d in args.image_shape.split(","))
  if args.side == "tq":  # TQ's venv: no knittrans_jax there
    import tq_side
    return tq_side.tq_side(args)
  if args.side == "ours":  # knittrans_jax from --ours_src (PYTHONPATH)
    import tq_ours_side
    return tq_ours_side.our_side(args)
  # Only the orchestrator imports knittrans_jax.bench: TQ's venv has no knittrans_jax, and
  # our side measures --ours_src's package, which may predate it.
  from knittrans_jax.bench.host import machine
  if (args.groups * args.n) % args.consumers or args.groups % args.consumers:
    p.error("--consumers must divide --groups")
  workloads = [w for w in args.workloads.split(",") if w]
  if not set(workloads) <= set(WORKLOAD_IDS):
    p.error(f"--workloads: from {sorted(WORKLOAD_IDS)}")

  tq_py = ensure_tq_venv(os.path.abspath(args.venv))
  os.makedirs(args.dir, exist_ok=True)
  store_dir = tempfile.mkdtemp(prefix="bench_vs_tq_", dir=args.dir)
  ray_tmp = tempfile.mkdtemp(prefix="rbtq_", dir="/tmp")  # short: Ray's socket paths
  token = os.path.join(ray_tmp, "auth_token")
  fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(secrets.token_hex(32))
  common = [os.path.abspath(__file__), "--json", args.json, "--groups", str(args.groups),
            "--n", str(args.n), "--prompt_len", str(args.prompt_len), "--response_len",
            str(args.response_len), "--image_shape", ",".join(map(str, args.image_shape)),
            "--consumers", str(args.consumers), "--seed", str(args.seed),
            "--our_clear", args.our_clear]
  tq_cmd = [tq_py] + common + ["--side", "tq", "--node_address", args.node_address,
                               "--ray_cpus", str(args.ray_cpus), "--tq_units", str(args.tq_units),
                               "--ray_tmp", ray_tmp, "--ray_token", token]
  ours_cmd = [sys.executable] + common + ["--side", "ours", "--store_dir", store_dir]
  env = dict(os.environ, PYTHONPATH=os.path.abspath(args.ours_src))
  tq_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  workers = {}
  load = [os.getloadavg()]
  t_start = time.time()
  results = {w: {} for w in workloads}
  try:
    print("starting TransferQueue (Ray, controller, storage units, consumers) and our "
          "store's consumers...", file=sys.stderr, flush=True)
    workers["tq"] = Worker("tq", tq_cmd, ROOT, tq_env)
    workers["ours"] = Worker("ours", ours_cmd, ROOT, env)
    setup = {name: w.recv(args.timeout) for name, w in workers.items()}
    runs = []  # (workload, side label)
    for w in workloads:
      runs.append((w, "tq"))
      runs += [(w, "ours_equal_bytes"), (w, "ours_dedup")] if w == "vlm" else [(w, "ours")]
    for rep in range(args.reps + 1):  # rep 0: the warm-up
      for w in workloads:
        order = [r for r in runs if r[0] == w]
        if rep % 2:
          order = order[1:] + order[:1]  # TQ last on odd reps
        for _, label in order:
          worker = workers["tq" if label == "tq" else "ours"]
          r = worker.call("rep", args.timeout, workload=w, rep=rep, label=label)
          if r["n_bad"] or r["checked"] != args.groups * args.n:
            raise RuntimeError(f"{label} {w} rep {rep}: {r['n_bad']} of {r['checked']} "
                               f"trajectories failed their CRC (uids {r['bad']}); expected "
                               f"{args.groups * args.n} checked")
          results[w].setdefault(label, []).append(r)
          print(f"  rep {rep}{' (warm-up)' if rep == 0 else ''} {w:<4} {label:<17} put "
                f"{r['put_s']:7.3f} s  get {r['get_s']:7.3f} s  clear {r['clear_s']:6.3f} s  "
                f"end to end {r['end_to_end_s']:7.3f} s", file=sys.stderr, flush=True)
      load.append(os.getloadavg())
  finally:
    for w in workers.values():
      w.close()
    shutil.rmtree(store_dir, ignore_errors=True)
    shutil.rmtree(ray_tmp, ignore_errors=True)

  out = {"payload": {"groups": args.groups, "n": args.n, "trajectories": args.groups * args.n,
                     "prompt_len": args.prompt_len, "response_len": args.response_len,
                     "image_shape": list(args.image_shape), "image_dtype": "float32",
                     "consumers": args.consumers, "seed": args.seed, "quick": args.quick},
         "reps": args.reps, "warmup_reps": 1, "our_clear": args.our_clear,
         "store_dir": args.dir, "tq_storage_units": args.tq_units,
         "tq_node_address": setup["tq"]["node_ip"],
         "machine": machine(), "load_average_per_rep": load,
         "wall_s": time.time() - t_start,
         "versions": {"tq_side": setup["tq"]["versions"], "our_side": setup["ours"]["versions"]},
         "setup_s": {k: v["setup_s"] for k, v in setup.items()},
         "notes": {
             "put": "TQ: client.put of the rep's TensorDict (a copy of the group's image per "
                    "trajectory) into a fresh partition. Ours: Image.of of each group's image "
                    "+ one writer.append of the rep to a long-lived unit.",
             "get": "Wall time from the go until both consumers hold a trainer-ready batch. "
                    "TQ: get_meta (GRPOGroupNSampler, task 'train') + get_data, then views of "
                    "the jagged tensors' buffers as [b, ...] (no copy). Ours: the metadata "
                    "records sent to each consumer + store.read(metas).result() + np.stack of "
                    "token ids, log-probs and images (a row per trajectory at equal bytes, a "
                    "row per distinct image with dedup). CRC checks come after, untimed.",
             "clear": "TQ: clear_partition. Ours: " + {
                 "retain": "store.retain_from past the rep + writer.reclaim (retention)",
                 "none": "nothing (it keeps every rep)",
                 "unit": "deleting the rep's unit (rmtree)"}[args.our_clear],
             "end_to_end": "put_s + get_s; end_to_end_with_clear_s adds clear_s",
             "ratio": "TQ median / our median (above 1: ours is faster)",
             "warmup": "rep 0 of each is a warm-up, not counted (per_rep lists the counted)"}}
  for w in workloads:
    res = {k: v[1:] for k, v in results[w].items()}
    tq = summarize(res["tq"])
    if w == "vlm":
      out[w] = {"tq": tq}
      for mode, label in (("dedup", "ours_dedup"), ("equal_bytes", "ours_equal_bytes")):
        ours = summarize(res[label])
        out[w][mode] = {"ours": ours, **ratios(tq, ours)}
    else:
      ours = summarize(res["ours"])
      out[w] = {"tq": tq, "ours": ours, **ratios(tq, ours)}
    out[w]["warmup"] = {k: v[0] for k, v in results[w].items()}
  out["pass_criterion"] = {
      "vlm_equal_bytes_ratio_at_least_1_5": (out["vlm"]["equal_bytes"]["end_to_end_ratio"] >= 1.5
                                             if "vlm" in out else None),
      "text_not_slower": out["text"]["end_to_end_ratio"] >= 1.0 if "text" in out else None}
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)

  mb = lambda x: x / 1e6
  print(f"\nTransferQueue {setup['tq']['versions']['transferqueue']} vs ours "
        f"({setup['ours']['versions']['knittrans_jax']}): {args.groups} groups x {args.n}, "
        f"{args.consumers} consumers, {out['machine']['nproc']} cores, medians of {args.reps} "
        f"reps after a warm-up; load average {load[0][0]:.1f} -> {load[-1][0]:.1f}")
  print(f"  {'workload':<18}{'side':<18}{'MB/rep':>9}{'put s':>9}{'get s':>9}{'clear s':>9}"
        f"{'e2e s':>9}{'e2e ratio':>11}")
  for w in workloads:
    rows = [("tq", out[w]["tq"], None)]
    if w == "vlm":
      rows += [(f"ours {m}", out[w][m]["ours"], out[w][m]["end_to_end_ratio"])
               for m in ("dedup", "equal_bytes")]
    else:
      rows.append(("ours", out[w]["ours"], out[w]["end_to_end_ratio"]))
    for side, s, ratio in rows:
      m = s["median"]
      print(f"  {w:<18}{side:<18}{mb(s['put_bytes']):>9.1f}{m['put_s']:>9.3f}{m['get_s']:>9.3f}"
            f"{m['clear_s']:>9.3f}{m['end_to_end_s']:>9.3f}"
            + (f"{ratio:>10.2f}x" if ratio is not None else ""))
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
