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
with its own); they share only numpy and this file's payload code.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB = 32000
WORKLOAD_IDS = {"text": 1, "vlm": 2}
TQ_VERSION = "0.1.11"
# The TQ venv: torch pinned to the CPU build this machine's pip configuration serves
# (requirements-test.txt), Ray as requirements-ray.txt pins it. TransferQueue's own
# requirements name hydra-core (which would downgrade omegaconf) and Ray's extras:
# it is installed without them, with what it imports.
TQ_DEPS = ["torch==2.13.0", "ray==2.60.0", "numpy", "omegaconf", "pyzmq", "msgspec", "psutil",
           "prometheus_client>=0.20.0", "cloudpickle", "orjson", "importlib_metadata", "packaging"]
TQ_NODEPS = [f"transferqueue=={TQ_VERSION}", "tensordict==0.15.3", "pyvers==0.2.3"]
PROTO = "@@"  # a worker's reply line starts with this


# ---------------------------------------------------------------- payload (both sides)

def make_rep(workload, rep, groups, n, prompt_len, response_len, image_shape, seed):
  """One rep's payload, from numpy alone so both venvs make the same bytes: a list of
  groups, each {gid, prompt [P], responses [n, R], logprobs [n, R], rewards [n],
  image (vlm) or None, crcs [n]}; trajectory uid = gid * n + index in group."""
  out = []
  for g in range(groups):
    rng = np.random.default_rng([seed, WORKLOAD_IDS[workload], rep, g])
    gid = rep * groups + g
    prompt = rng.integers(0, VOCAB, prompt_len, dtype=np.int32)
    responses = rng.integers(0, VOCAB, (n, response_len), dtype=np.int32)
    logprobs = -rng.random((n, response_len), dtype=np.float32)
    rewards = rng.random(n, dtype=np.float32)
    image = rng.random(image_shape, dtype=np.float32) if workload == "vlm" else None
    base = image_crc(image)
    crcs = [traj_crc(base, np.concatenate([prompt, responses[i]]), logprobs[i])
            for i in range(n)]
    out.append(dict(gid=gid, prompt=prompt, responses=responses, logprobs=logprobs,
                    rewards=rewards, image=image, crcs=crcs))
  return out


def image_crc(image) -> int:
  return 0 if image is None else zlib.crc32(np.ascontiguousarray(image).reshape(-1).view(np.uint8))


def traj_crc(base: int, tokens, response_logprobs) -> int:
  """CRC32 of a trajectory: its image's bytes (`base` = image_crc), then its token ids
  (prompt + response, int32), then its response log-probs (float32)."""
  crc = zlib.crc32(np.ascontiguousarray(tokens, np.int32).view(np.uint8), base)
  return zlib.crc32(np.ascontiguousarray(response_logprobs, np.float32).view(np.uint8), crc)


def expected_crcs(payload, n):
  return {g["gid"] * n + i: c for g in payload for i, c in enumerate(g["crcs"])}


def payload_bytes(payload, copies_per_traj: bool) -> int:
  """Bytes handed to the store: ids, log-probs, loss mask, reward, images."""
  total = 0
  for g in payload:
    n, r = g["responses"].shape
    total += n * (g["prompt"].nbytes + r * (4 + 4 + 1) + 4)
    if g["image"] is not None:
      total += g["image"].nbytes * (n if copies_per_traj else 1)
  return total


def check_rows(expected, uids, tokens, logprobs, prompt_len, images, image_of_row):
  """Checks rows against the producer's CRCs; returns (rows checked, bad uids).
  images[image_of_row[j]] is row j's image (None: no images); a distinct image index is
  hashed once."""
  bad, cache = [], {}
  for j, uid in enumerate(uids):
    base = 0
    if images is not None:
      k = image_of_row[j]
      if k not in cache:
        cache[k] = image_crc(images[k])
      base = cache[k]
    if expected.get(uid) != traj_crc(base, tokens[j], logprobs[j][prompt_len:]):
      bad.append(uid)
  return len(uids), bad


# ---------------------------------------------------------------- worker plumbing

def _serve(handlers):
  """A worker's loop: a JSON request a line on stdin, a PROTO-prefixed JSON reply on
  stdout. Anything else printing to stdout (libraries, Ray) goes to stderr."""
  proto = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  sys.stdout = sys.stderr

  def reply(obj):
    proto.write(PROTO + json.dumps(obj) + "\n")
    proto.flush()
  try:
    reply({"ready": True, **handlers["setup"]()})
    for line in sys.stdin:
      req = json.loads(line)
      if req["op"] == "close":
        break
      reply(handlers[req["op"]](**req.get("args", {})))
  except BaseException as e:  # the orchestrator reports it
    import traceback
    reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    raise
  finally:
    handlers["close"]()
    reply({"closed": True})


# ---------------------------------------------------------------- TransferQueue side

class TQConsumer:
  """A trainer rank: its own TQ client, attached to the running controller."""

  def __init__(self, rank):
    import transfer_queue as tq
    tq.init()  # finds the controller, makes this process's client
    self.client, self.rank, self.expected = tq.get_client(), rank, {}

  def ready(self):
    return True

  def expect(self, crcs):
    self.expected = crcs

  def get(self, partition, batch_size, fields):
    import torch
    t0 = time.perf_counter()
    retries = 0
    while True:  # the whole batch is put before the go; a short answer is retried
      try:
        meta = self.client.get_meta(data_fields=fields, batch_size=batch_size,
                                    partition_id=partition, task_name="train")
        if meta.size == batch_size:
          break
      except Exception:
        if retries > 2000:
          raise
      retries += 1
      time.sleep(0.001)
    t_meta = time.perf_counter()
    td = self.client.get_data(meta)
    t_api = time.perf_counter()
    views = 0

    def dense(x):  # a trainer's batch: the jagged tensor's buffer, viewed [b, ...]
      nonlocal views
      if not getattr(x, "is_nested", False):
        return x
      vals, lengths = x.values(), x.offsets().diff()
      if bool((lengths == lengths[0]).all()):
        out = vals.view(batch_size, int(lengths[0]), *vals.shape[1:])
        views += 1
        return out
      return torch.nested.to_padded_tensor(x, 0)
    batch = {k: dense(td[k]) for k in fields}
    tokens = batch["input_ids"].numpy()
    logprobs = batch["logprobs"].numpy()
    images = batch["image"].numpy() if "image" in batch else None
    t1 = time.perf_counter()
    uids = batch["uid"].numpy().tolist()
    nbytes = sum(v.numel() * v.element_size() for v in batch.values())
    # TQ's log-probs cover the response only (prompt_len 0 in the check)
    checked, bad = check_rows(self.expected, uids, tokens, logprobs, 0, images,
                              list(range(len(uids))))
    return {"get_s": t1 - t0, "get_meta_s": t_meta - t0, "get_api_s": t_api - t0,
            "batch_s": t1 - t_api, "meta_retries": retries, "dense_views": views,
            "bytes": nbytes, "checked": checked, "bad": bad[:5], "n_bad": len(bad)}


def tq_side(args):
  os.environ.setdefault("TQ_NUM_THREADS", str(len(os.sched_getaffinity(0))))  # its cap anyway
  os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")
  os.environ["RAY_AUTH_TOKEN_PATH"] = args.ray_token
  import ray
  import tensordict
  import torch
  from omegaconf import OmegaConf
  from tensordict import TensorDict

  import transfer_queue as tq
  st = {}

  def setup():
    t0 = time.perf_counter()
    ray.init(num_cpus=args.ray_cpus, _node_ip_address=args.node_address, include_dashboard=False,
             log_to_driver=False, _temp_dir=args.ray_tmp)
    conf = OmegaConf.create(
        {"controller": {"sampler": tq.GRPOGroupNSampler(n_samples_per_prompt=args.n)},
         "backend": {"storage_backend": "SimpleStorage",
                     "SimpleStorage": {"num_data_storage_units": args.tq_units}}},
        flags={"allow_objects": True})
    tq.init(conf)
    st["client"] = tq.get_client()
    actor = ray.remote(num_cpus=1)(TQConsumer)
    st["consumers"] = [actor.remote(r) for r in range(args.consumers)]
    ray.get([c.ready.remote() for c in st["consumers"]])
    from importlib.metadata import version
    return {"setup_s": time.perf_counter() - t0, "node_ip": ray.util.get_node_ip_address(),
            "versions": {"transferqueue": version("transferqueue"), "torch": torch.__version__,
                         "ray": ray.__version__, "tensordict": tensordict.__version__,
                         "numpy": np.__version__, "python": platform.python_version()}}

  def rep(workload, rep, label):
    payload = make_rep(workload, rep, args.groups, args.n, args.prompt_len, args.response_len,
                       args.image_shape, args.seed)
    n, b = args.n, args.n * args.groups
    fields = {
        "input_ids": np.concatenate([np.concatenate(
            [np.broadcast_to(g["prompt"], (n, args.prompt_len)), g["responses"]], 1)
            for g in payload]),
        "logprobs": np.concatenate([g["logprobs"] for g in payload]),
        "loss_mask": np.ones((b, args.response_len), bool),
        "reward": np.concatenate([g["rewards"] for g in payload]),
        "uid": np.arange(b, dtype=np.int64) + payload[0]["gid"] * n}
    if workload == "vlm":  # TQ stores what it is given: a copy per trajectory
      fields["image"] = np.repeat(np.stack([g["image"] for g in payload]), n, axis=0)
    td = TensorDict({k: torch.from_numpy(v) for k, v in fields.items()}, batch_size=[b])
    part = f"{workload}_{rep}"
    ray.get([c.expect.remote(expected_crcs(payload, n)) for c in st["consumers"]])
    client = st["client"]
    t0 = time.perf_counter()
    client.put(td, partition_id=part)
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = ray.get([c.get.remote(part, b // args.consumers, list(fields))
                   for c in st["consumers"]])
    get_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    client.clear_partition(part)
    clear_s = time.perf_counter() - t0
    return _rep_result(put_s, get_s, clear_s, res, payload_bytes(payload, True))

  def close():
    try:
      if "client" in st:
        tq.close()
    finally:
      ray.shutdown()

  _serve({"setup": setup, "rep": rep, "close": close})


def _rep_result(put_s, get_s, clear_s, consumers, put_bytes):
  return {"put_s": put_s, "get_s": get_s, "clear_s": clear_s, "end_to_end_s": put_s + get_s,
          "end_to_end_with_clear_s": put_s + get_s + clear_s,
          "get_api_s": max(r["get_api_s"] for r in consumers),
          "batch_s": max(r["batch_s"] for r in consumers),
          "put_bytes": put_bytes, "read_bytes": sum(r["bytes"] for r in consumers),
          "checked": sum(r["checked"] for r in consumers),
          "n_bad": sum(r["n_bad"] for r in consumers),
          "bad": [u for r in consumers for u in r["bad"]][:5], "consumers": consumers}


# ---------------------------------------------------------------- our side

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
    return _rep_result(put_s, get_s, clear_s, res, payload_bytes(payload, not dedup))

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

  _serve({"setup": setup, "rep": rep, "close": close})


def _with_image(traj, image_id):
  import dataclasses
  return dataclasses.replace(traj, image_ids=(image_id,))


# ---------------------------------------------------------------- orchestration

class Worker:
  """One side's long-lived worker process and its reply stream."""

  def __init__(self, name, cmd, env=None):
    self.name = name
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=env, start_new_session=True, cwd=ROOT)
    self.lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._pump, daemon=True).start()

  def _pump(self):
    for line in self.proc.stdout:
      if line.startswith(PROTO):
        self.lines.put(json.loads(line[len(PROTO):]))
      else:
        sys.stderr.write(f"[{self.name}] {line}")
    self.lines.put(None)

  def recv(self, timeout):
    try:
      msg = self.lines.get(timeout=timeout)
    except queue.Empty:
      raise TimeoutError(f"{self.name}: no answer in {timeout} s") from None
    if msg is None:
      raise RuntimeError(f"{self.name}: the worker exited (code {self.proc.wait()})")
    if "error" in msg:
      raise RuntimeError(f"{self.name}: {msg['error']}\n{msg.get('traceback', '')}")
    return msg

  def call(self, op, timeout, **kw):
    self.proc.stdin.write(json.dumps({"op": op, "args": kw}) + "\n")
    self.proc.stdin.flush()
    return self.recv(timeout)

  def close(self, timeout=120):
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=timeout)
      except (OSError, subprocess.TimeoutExpired):
        pass
    if self.proc.poll() is None:  # its own process group: the worker and what it started
      try:
        os.killpg(self.proc.pid, 9)
      except ProcessLookupError:
        pass
      self.proc.wait()


def ensure_tq_venv(venv):
  """The TransferQueue venv's python, building the venv first when missing."""
  py = os.path.join(venv, "bin", "python")
  stamp = os.path.join(venv, ".installed-tq")
  if os.path.exists(stamp):
    return py
  print(f"building the TransferQueue {TQ_VERSION} venv in {venv} (pip; a few minutes)...",
        file=sys.stderr, flush=True)
  if not os.path.exists(py):
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
  pip = [py, "-m", "pip", "install", "-q"]
  subprocess.run(pip + TQ_DEPS, check=True)
  subprocess.run(pip + ["--no-deps"] + TQ_NODEPS, check=True)
  check = ("import torch, transfer_queue; assert torch.version.cuda is None, torch.__version__; "
           "print(torch.__version__)")
  out = subprocess.run([py, "-c", check], check=True, capture_output=True, text=True)
  with open(stamp, "w") as f:
    f.write(f"transferqueue=={TQ_VERSION} torch=={out.stdout.strip()}\n")
  print(f"TransferQueue venv ready (torch {out.stdout.strip()})", file=sys.stderr, flush=True)
  return py


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


def machine():
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
  if args.side == "tq":
    return tq_side(args)
  if args.side == "ours":
    return our_side(args)
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
    workers["tq"] = Worker("tq", tq_cmd, tq_env)
    workers["ours"] = Worker("ours", ours_cmd, env)
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
