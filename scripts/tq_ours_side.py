"""Our side of scripts/bench_vs_transferqueue.py (`--side ours`, the project's venv): a
TrajectoryStore's producer and its consumer processes. The store code is the one on
PYTHONPATH (--ours_src); the harness (payload, worker loop) comes from scripts/."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time

import numpy as np
from line_worker import serve
from tq_payload import check_rows, expected_crcs, make_rep, payload_bytes, rep_result


def our_consumer(rank, conn):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from knittrans_jax.storage import TrajectoryStore
  stores, expected = {}, {}
  conn.send("ready")
  while True:
    msg = conn.recv()
    if msg[0] == "close":
      return
    if msg[0] == "expect":
      expected = msg[1]
      conn.send("ok")
      continue
    _, url, metas, dedup = msg
    t0 = time.perf_counter()
    if url not in stores:  # opened by the warm-up rep, as a long-lived consumer has it
      stores[url] = TrajectoryStore.open(url)
    payload = stores[url].read(metas).result()
    t_api = time.perf_counter()
    tokens = np.stack(payload.tokens)
    logprobs = np.stack(payload.logprobs)
    images = index = None
    if payload.images:
      if dedup:  # one row a distinct image, and each trajectory's row in it
        ids = list(dict.fromkeys(m.image_ids[0] for m in metas))
        pos = {iid: k for k, iid in enumerate(ids)}
        images = np.stack([payload.images[iid] for iid in ids])
        index = [pos[m.image_ids[0]] for m in metas]
      else:  # a row a trajectory, as TQ's batch
        images = np.stack([payload.images[m.image_ids[0]] for m in metas])
        index = list(range(len(metas)))
    t1 = time.perf_counter()
    nbytes = tokens.nbytes + logprobs.nbytes + sum(m.nbytes for m in payload.loss_mask)
    nbytes += payload.image_nbytes_read
    conn.send({"get_s": t1 - t0, "get_api_s": t_api - t0, "batch_s": t1 - t_api,
               "bytes": int(nbytes)})
    uids = [m.group_id * expected["n"] + m.index_in_group for m in metas]
    checked, bad = check_rows(expected["crcs"], uids, tokens, logprobs,
                              metas[0].prompt_len if metas else 0, images, index)
    conn.send({"checked": checked, "bad": bad[:5], "n_bad": len(bad)})


def our_side(args):
  import multiprocessing as mp
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from importlib.metadata import version

  from knittrans_jax.storage import Image, StoreSchema, TrajectoryStore
  from knittrans_jax.types import Trajectory
  st = {"stores": {}, "writers": {}, "unit_rep": {}}

  def setup():
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    st["conns"], st["procs"] = [], []
    for r in range(args.consumers):
      a, b = ctx.Pipe()
      p = ctx.Process(target=our_consumer, args=(r, b), daemon=True)
      p.start()
      st["conns"].append(a)
      st["procs"].append(p)
    for c in st["conns"]:
      if c.recv() != "ready":
        raise RuntimeError("a consumer did not start")
    import knittrans_jax
    src = os.path.dirname(os.path.dirname(os.path.abspath(knittrans_jax.__file__)))
    commit = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "knittrans_jax"],
                           capture_output=True, text=True).stdout.strip()
    return {"setup_s": time.perf_counter() - t0,
            "versions": {"knittrans_jax": commit + ("+changes" if dirty else ""),
                         "knittrans_jax_src": src,
                         "tensorstore": version("tensorstore"), "numpy": np.__version__,
                         "python": platform.python_version()}}

  def store_of(label, dedup):
    if label not in st["stores"]:
      url = "file://" + os.path.join(args.store_dir, label)
      st["stores"][label] = TrajectoryStore.create(url, StoreSchema(
          sources=("text", "vqa"), max_prompt_len=args.prompt_len,
          max_response_len=args.response_len, dedup_images=dedup))
    return st["stores"][label]

  def writer_of(label, store, rep):
    unit = f"rep{rep}" if args.our_clear == "unit" else "producer0"
    key = (label, unit)
    if key not in st["writers"]:
      st["writers"][key] = store.writer(unit)
    return unit, st["writers"][key]

  def rep(workload, rep, label):
    dedup = label != "ours_equal_bytes"
    store = store_of(label, dedup)
    unit, writer = writer_of(label, store, rep)  # open before the clock: a job has it open
    payload = make_rep(workload, rep, args.groups, args.n, args.prompt_len, args.response_len,
                       args.image_shape, args.seed)
    n, source = args.n, "vqa" if workload == "vlm" else "text"
    mask = np.ones(args.response_len, bool)
    trajs = [[Trajectory(prompt_tokens=g["prompt"], response_tokens=g["responses"][i],
                         logprobs=g["logprobs"][i], loss_mask=mask, reward=float(g["rewards"][i]),
                         source=source, group_id=g["gid"], index_in_group=i, versions=(0,))
              for i in range(n)] for g in payload]
    expect = {"n": n, "crcs": expected_crcs(payload, n)}
    for c in st["conns"]:
      c.send(("expect", expect))
    for c in st["conns"]:
      c.recv()
    t0 = time.perf_counter()
    images, flat = [], []
    for g, group in zip(payload, trajs):
      if g["image"] is not None:
        image = Image.of(g["image"])  # the producer's one hash of its image
        images.append(image)
        group = [_with_image(t, image.id) for t in group]
      flat += group
    metas = writer.append(flat, images=images)
    put_s = time.perf_counter() - t0
    per = len(metas) // args.consumers  # whole groups each (groups are consecutive)
    halves = [metas[r * per:(r + 1) * per] for r in range(args.consumers)]
    url = store.url
    t0 = time.perf_counter()
    for c, half in zip(st["conns"], halves):
      c.send(("get", url, half, dedup))
    res = [c.recv() for c in st["conns"]]
    get_s = time.perf_counter() - t0
    for r, c in zip(res, st["conns"]):
      r.update(c.recv())
    clear_s = 0.0
    if args.our_clear == "retain":  # the rep is consumed: below the watermark, reclaimed
      t0 = time.perf_counter()
      store.retain_from(unit, writer.commit.rows)
      writer.reclaim()
      clear_s = time.perf_counter() - t0
    elif args.our_clear == "unit":  # what reclaiming a consumed rep would cost
      t0 = time.perf_counter()
      root = store.url[len("file://"):]
      shutil.rmtree(os.path.join(root, unit))
      os.remove(os.path.join(root, "_units", unit))
      clear_s = time.perf_counter() - t0
      del st["writers"][(label, unit)]
    return rep_result(put_s, get_s, clear_s, res, payload_bytes(payload, not dedup))

  def close():
    for c in st.get("conns", []):
      try:
        c.send(("close",))
      except OSError:
        pass
    for p in st.get("procs", []):
      p.join(timeout=30)
      if p.is_alive():
        p.kill()

  serve({"setup": setup, "rep": rep, "close": close})


def _with_image(traj, image_id):
  import dataclasses
  return dataclasses.replace(traj, image_ids=(image_id,))
