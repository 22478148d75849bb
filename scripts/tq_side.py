"""TransferQueue's side of scripts/bench_vs_transferqueue.py (`--side tq`, in TQ's venv):
Ray, TQ's controller and storage units, the producer's puts and the consumer actors'
get_meta + get_data. Its consumers are Ray actors: Ray's workers import this module
from scripts/, which Ray puts on their path (the driver's script directory)."""
from __future__ import annotations

import os
import platform
import time

import numpy as np
from line_worker import serve
from tq_payload import check_rows, expected_crcs, make_rep, payload_bytes, rep_result


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
    return rep_result(put_s, get_s, clear_s, res, payload_bytes(payload, True))

  def close():
    try:
      if "client" in st:
        tq.close()
    finally:
      ray.shutdown()

  serve({"setup": setup, "rep": rep, "close": close})
