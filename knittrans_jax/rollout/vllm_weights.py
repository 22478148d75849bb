"""The weight path into a vLLM engine's workers: a `worker_extension_cls` mixed into
vLLM's worker class, called through `collective_rpc` (rollout/vllm_engine.py in this
process; rollout/vllm_server_engine.py over the server's /collective_rpc route).

A version arrives as the path of a shared-memory segment in Hugging Face layout
(rollout/hf_segment.py, written once by the engine's owner on this host): the worker
maps it, wraps each tensor as a torch view of the mapping (no copy, no unpickling) and
reloads the model in place from them (`model_runner.reload_weights`: vLLM's own load,
the one copy into its parameters, then its post-load processing). The CPU backend
packs each linear layer's weight for its GEMM when a model loads; a tied lm_head
shares the embedding's tensor but is not re-processed by the reload (it keeps
multiplying by the old packed weights: log-prob errors of ~4 nats were seen), so it is
packed again here. The engine then resets its prefix cache. A server on another host
cannot open the path: the 'vllm_server' engine says so (docs/rollout.md).

This module loads neither JAX nor the rest of the project (it runs inside vLLM's
workers): numpy, torch and the segment reader.

GPU (written, UNTESTED here: no GPU or CUDA build of vLLM on this machine): the same
call works, with tensors put on the worker's device by reload_weights (a host-to-device
copy per tensor from the mapping). Across hosts the bytes should not pass through
files: vLLM's weight-transfer engine (NCCL broadcast from a trainer rank that joins
the engine's process group, `init_weight_transfer` + `update_weights` on the engine)
moves them device to device. Not written here.

TPU: vllm-tpu (tpu-inference) holds the weights as JAX arrays; a JAX trainer on the
same slice hands over arrays (its `sync_weights`), no bytes at all. Not runnable here.
"""
from __future__ import annotations

import json
import time

import numpy as np

from knittrans_jax.rollout.weight_segment import SegmentError, read_segment


def _torch_view(array: np.ndarray):
  """A torch tensor over `array`'s memory (bfloat16 through its 16-bit pattern: torch
  does not take ml_dtypes' bfloat16 from numpy)."""
  import torch
  if array.dtype.name == "bfloat16":
    return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
  return torch.from_numpy(array)


class WeightLoader:
  """Methods vLLM adds to its worker (names prefixed: the worker must not have them).
  Arguments are strings: the server's /collective_rpc route passes nothing else."""

  def knittrans_check(self) -> dict:
    """What the engine's owner checks before using a server: its settings."""
    mc = self.model_config
    return {"logprobs_mode": str(mc.logprobs_mode), "max_model_len": int(mc.max_model_len),
            "dtype": str(mc.dtype).replace("torch.", ""), "vocab_size": int(mc.get_vocab_size()),
            "block_size": int(self.vllm_config.cache_config.block_size)}

  def knittrans_load_segment(self, path: str, verify: str = "0") -> dict:
    """Reloads the model from the segment at `path` (every tensor whole); `verify`
    '1': check the data's crc32c first, where it has one. Returns the tensors loaded,
    the segment's version and the seconds to map it and to load (vLLM's reload)."""
    t0 = time.perf_counter()
    head, pieces = read_segment(path, verify=verify == "1")
    weights = []
    for p in pieces:
      if p.box != tuple((0, n) for n in p.data.shape):
        raise SegmentError(f"weight segment {path}: {p.name} is a part {p.box} of a tensor; "
                           "an engine loads whole tensors")
      weights.append((p.name, _torch_view(p.data)))
    t1 = time.perf_counter()
    self.model_runner.reload_weights(weights_iterator=iter(weights))
    self._knittrans_repack_head()
    return {"tensors": len(weights), "version": head["version"], "map_s": t1 - t0,
            "load_s": time.perf_counter() - t1}

  def knittrans_load_views(self, plan: str) -> dict:
    """Reloads the model from strided views of segments its owner maps (JSON
    [{name, file, offset, dtype, shape, strides}], rollout/hf_segment.hf_views): each
    file mapped once, each tensor a torch view of it (transposed or a layer of a stack
    by its strides; vLLM's load copies it into its parameters)."""
    import mmap

    import torch
    t0 = time.perf_counter()
    entries, bases, weights = json.loads(plan), {}, []
    for e in entries:
      if e["file"] not in bases:
        with open(e["file"], "rb") as f:
          mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        bases[e["file"]] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
      mm, raw = bases[e["file"]]
      dtype = getattr(torch, e["dtype"])
      item = torch.empty((), dtype=dtype).element_size()
      if e["offset"] % item or any(st % item for st in e["strides"]):
        raise ValueError(f"{e['name']}: offset {e['offset']} or strides {e['strides']} are not "
                         f"whole {e['dtype']} elements")
      typed = raw[:raw.numel() - raw.numel() % item].view(dtype)
      weights.append((e["name"], torch.as_strided(
          typed, e["shape"], [st // item for st in e["strides"]], e["offset"] // item)))
    t1 = time.perf_counter()
    self.model_runner.reload_weights(weights_iterator=iter(weights))
    self._knittrans_repack_head()
    return {"tensors": len(weights), "files": len(bases), "map_s": t1 - t0,
            "load_s": time.perf_counter() - t1}

  def _knittrans_repack_head(self) -> None:
    """A tied head only (an untied one was reloaded, and so re-packed, with the rest)."""
    model = self.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight:
      return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
      method.process_weights_after_loading(head)
