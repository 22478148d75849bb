"""The weight path into a vLLM engine's workers: a `worker_extension_cls` mixed into
vLLM's worker class, called through `collective_rpc` (rollout/vllm_engine.py).

CPU (tested): tensors travel as (HF name, bytes, dtype, shape), since numpy arrays in
collective_rpc's arguments do not survive its serialisation; the worker rebuilds
tensors and reloads them in place (`model_runner.reload_weights`). The CPU backend
packs each linear layer's weight for its GEMM when a model loads; a tied lm_head
shares the embedding's tensor but is not re-processed by the reload (it keeps
multiplying by the old packed weights: log-prob errors of ~4 nats were seen), so it is
packed again here. The engine then resets its prefix cache.

GPU (written, UNTESTED here: no GPU or CUDA build of vLLM on this machine): the same
call works, with tensors put on the worker's device by reload_weights. At scale the
bytes should not pass through the RPC: vLLM's weight-transfer engine (NCCL broadcast
from a trainer rank that joins the engine's process group, `init_weight_transfer` +
`update_weights` on the engine) moves them device to device; for a trainer on the
same host, CUDA IPC (each tensor exported with torch.multiprocessing's reductions,
rebuilt in the worker) would be the form of it. Neither is written here.

TPU: vllm-tpu (tpu-inference) holds the weights as JAX arrays; a JAX trainer on the
same slice hands over arrays (its `sync_weights`), no bytes at all. Not runnable here.
"""
from __future__ import annotations

import numpy as np


class WeightLoader:
  """Methods vLLM adds to its worker (names prefixed: the worker must not have them)."""

  def knittrans_load(self, items: list[tuple[str, bytes, str, tuple[int, ...]]]) -> int:
    import torch
    weights = [(name, torch.from_numpy(np.frombuffer(data, dtype=dtype).reshape(shape).copy()))
               for name, data, dtype, shape in items]
    self.model_runner.reload_weights(weights_iterator=iter(weights))
    self._knittrans_repack_head()
    return len(weights)

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
