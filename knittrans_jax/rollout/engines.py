"""The rollout engine factory: the backend an EngineSpec names (rollout/engine.py is the
interface the backends implement; this module is the one that imports them)."""
from __future__ import annotations

from knittrans_jax.rollout.engine import EngineSpec, RolloutEngine


def make_engine(spec: EngineSpec, graphdef, params, version: int) -> RolloutEngine:
  """The engine `spec` names, holding `params` (an nnx.State of host arrays) at `version`.
  `graphdef`: the decoder's (the 'jax' engine's; vLLM builds its own model). The backends
  are imported here, not above: vLLM loads only when used."""
  if spec.name == "vllm":
    from knittrans_jax.rollout.vllm_engine import VllmEngine
    return VllmEngine(spec, params, version)
  if spec.name == "vllm_server":
    from knittrans_jax.rollout.vllm_server_engine import VllmServerEngine
    return VllmServerEngine(spec, params, version)
  from knittrans_jax.rollout.jax_engine import JaxEngine
  return JaxEngine(spec, graphdef, params, version)
