"""Task suites: each task family in one module, behind one interface (suites/base.py).

    suite = suites.build(cfg, DecoderConfig())   # JobConfig.suite, once, at set-up

  text     suites/text.py     the tiny decoder's synthetic tasks
  math     suites/math.py     a prompt data set through a tokenizer, the math reward
  agentic  suites/agentic.py  multi-turn tool episodes
  vision   suites/vision.py   generated images on the tiny VLM, or on a Qwen-VL
                              checkpoint (suites/qwen_vl.py)

`build` is part of the run's root (job/setup.py calls it once): it builds each
suite's gin configs here and nowhere below. A new suite is a module here and a line
in `build`.
"""
from __future__ import annotations

from knittrans_jax.models import DecoderConfig, ViTConfig, hf
from knittrans_jax.models.vision_spec import VisionSpec
from knittrans_jax.rollout.agent_loop import AgentConfig
from knittrans_jax.rollout.agentic_tasks import AgenticTaskConfig
from knittrans_jax.rollout.math_tasks import MathTaskConfig
from knittrans_jax.rollout.qwen_vision_tasks import QwenVisionTaskConfig
from knittrans_jax.suites.agentic import AgenticSuite
from knittrans_jax.suites.base import BatchFields, OneStepEnv, RolledGroup, TaskSuite
from knittrans_jax.suites.math import MathSuite
from knittrans_jax.suites.qwen_vl import QwenVLSuite
from knittrans_jax.suites.text import TextSuite
from knittrans_jax.suites.vision import VisionSuite

NAMES = ("text", "vision", "math", "agentic")

__all__ = ["NAMES", "AgenticSuite", "BatchFields", "MathSuite", "OneStepEnv", "QwenVLSuite",
           "RolledGroup", "TaskSuite", "TextSuite", "VisionSuite", "build", "check_name"]


def check_name(name: str) -> str:
  if name not in NAMES:
    raise ValueError(f"JobConfig.suite = {name!r}: use one of {NAMES}")
  return name


def build(cfg, decoder: DecoderConfig) -> TaskSuite:
  """JobConfig `cfg`'s suite with its configs as gin binds them; `decoder` gives a
  Qwen-VL checkpoint's dtype, param_dtype, remat and attention."""
  name = check_name(cfg.suite)
  if name == "text":
    return TextSuite()
  if name == "agentic":
    return AgenticSuite(AgenticTaskConfig(), AgentConfig())
  if name == "math":
    config = MathTaskConfig()
    tokenizer = config.tokenizer or cfg.checkpoint
    if tokenizer is None:
      raise ValueError("JobConfig.suite = 'math' needs a tokenizer: set JobConfig.checkpoint "
                       "or MathTaskConfig.tokenizer")
    return MathSuite(config, tokenizer, cfg.seed)
  if not cfg.checkpoint:
    return VisionSuite(VisionSpec.tiny(ViTConfig()))
  d = decoder
  return QwenVLSuite(VisionSpec.from_qwen_checkpoint(
      cfg.checkpoint, QwenVisionTaskConfig().image_size, dtype=d.dtype, param_dtype=d.param_dtype,
      remat=d.remat, attention=d.attention))


def decoder_config(suite: TaskSuite, checkpoint: str | None, decoder: DecoderConfig):
  """The policy's language model: gin's DecoderConfig, or with a checkpoint its
  config.json's architecture under gin's dtype, param_dtype, remat and attention."""
  if not checkpoint:
    return decoder
  if isinstance(suite, QwenVLSuite):  # its language model
    return suite.spec.qwen.text
  d = decoder
  return hf.config_from_hf(hf.read_config(checkpoint), dtype=d.dtype, param_dtype=d.param_dtype,
                           remat=d.remat, attention=d.attention)
