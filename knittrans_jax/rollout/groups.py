"""One GRPO group: a task from its seed, n sampled responses, scored trajectories.

Three task suites: 'text' (rollout/tasks.py), 'vision' (rollout/vision_tasks.py,
one generated image per prompt, shared by the group's n responses: the sampler
encodes it once and the group stores it once) and 'math' (rollout/math_tasks.py: a
prompt data set through a real tokenizer, the verifiable math reward). The math
suite needs its `MathSource` (config, tokenizer directory), passed as `math`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from knittrans_jax.rollout import math_tasks, tasks, vision_tasks
from knittrans_jax.rollout.qwen_vision_tasks import QwenVisionTasks
from knittrans_jax.rollout.sampler import SamplerConfig, generate
from knittrans_jax.storage import Image
from knittrans_jax.types import Trajectory

PROMPT_LEN = 5  # the longest text prompt; prompts are left-padded to it
SUITES = ("text", "vision", "math")


@dataclasses.dataclass(frozen=True)
class MathSource:
  """What a process needs to build the math suite (picklable, sent to workers)."""
  config: math_tasks.MathTaskConfig
  tokenizer_dir: str
  seed: int = 0

  def suite(self) -> math_tasks.MathTasks:
    return math_tasks.suite_for(self.config, self.tokenizer_dir, self.seed)


def suite_sources(suite: str, math: MathSource | None = None) -> tuple[str, ...]:
  if _check(suite, math) == "math":
    return math.suite().sources
  return {"text": tasks.SOURCES, "vision": vision_tasks.SOURCES}[suite]


def suite_prompt_len(suite: str, math: MathSource | None = None) -> int:
  if _check(suite, math) == "math":
    return math.config.prompt_len
  return {"text": PROMPT_LEN, "vision": vision_tasks.PROMPT_LEN}[suite]


def _check(suite: str, math: MathSource | None = None) -> str:
  if suite not in SUITES:
    raise ValueError(f"task suite {suite!r} is unknown; use one of {SUITES}")
  if suite == "math" and math is None:
    raise ValueError("the 'math' suite needs its MathSource (prompt file and tokenizer)")
  return suite


def task_for(seed: int, group_id: int, source: str, suite: str = "text", image_size: int = 32,
             math: MathSource | None = None):
  """The task of a group is a pure function of (seed, group id, source)."""
  if _check(suite, math) == "math":
    return math.suite().task(group_id, source)
  rng = np.random.default_rng([seed, group_id])
  if suite == "vision":
    return vision_tasks.make_task(rng, source, image_size)
  return tasks.make_task(rng, source)


@functools.partial(jax.jit, static_argnums=2)
def _group_keys(seed, group_ids, n):
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), group_ids)
  return jax.vmap(lambda k: jax.random.split(k, n))(keys).reshape(-1)


def group_keys(seed: int, group_ids: list[int], n: int) -> jax.Array:
  """One sampling key per response: [len(group_ids) * n], group-major."""
  return _group_keys(np.uint32(seed), np.asarray(group_ids, np.uint32), n)


@dataclasses.dataclass
class RolledGroup:
  trajectories: list[Trajectory]
  images: list[Image]  # stored once for the whole group (empty for text); id hashed once


def rollout_groups(graphdef, params, version: int, seed: int, requests: list[tuple[int, str]],
                   n: int, sampler: SamplerConfig, suite: str = "text",
                   image_size: int = 32, math: MathSource | None = None,
                   qwen: QwenVisionTasks | None = None) -> list[RolledGroup]:
  """Generates n responses for each (group id, source) in one sampler call.

  `qwen`: the vision suite on a Qwen-VL checkpoint (rollout/qwen_vision_tasks.py): its
  prompts carry the image's image-pad tokens and the store keeps the uint8 image.

  Response i of group g samples with key (seed, g, i) (`group_keys`), so a group
  comes out the same however groups are batched into calls: a worker's few, the
  colocated reference's many (up to float reassociation in batched matmuls).
  """
  if qwen is not None:
    if suite != "vision":
      raise ValueError(f"a Qwen-VL vision suite with task suite {suite!r}; it runs 'vision'")
    image_size = qwen.image_size
  task_list = [task_for(seed, gid, source, suite, image_size, math) for gid, source in requests]
  prompt_of = qwen.prompt if qwen is not None else (lambda t: t.prompt)
  prompts = [prompt_of(t) for t in task_list for _ in range(n)]
  rng = group_keys(seed, [gid for gid, _ in requests], n)
  score = {"vision": vision_tasks.score, "text": tasks.score}.get(suite) or math.suite().score
  stored, extra = [], {}
  if suite == "vision":
    stored = [qwen.stored_image(t) if qwen is not None else t.image for t in task_list]
    extra = dict(images=stored if qwen is not None else np.stack(stored),
                 image_index=np.repeat(np.arange(len(task_list)), n),
                 qwen=qwen.inputs if qwen is not None else None,
                 banned=qwen.special_ids if qwen is not None else ())
  prompt_len = qwen.prompt_len if qwen is not None else suite_prompt_len(suite, math)
  outs = generate(graphdef, params, prompts, rng, sampler, prompt_len=prompt_len, **extra)
  groups = []
  for k, ((gid, source), task) in enumerate(zip(requests, task_list)):
    images = [Image.of(stored[k])] if suite == "vision" else []  # the only hash of it
    ids = tuple(im.id for im in images)
    groups.append(RolledGroup([
        Trajectory(prompt_tokens=prompt_of(task), response_tokens=resp, logprobs=lp,
                   loss_mask=np.ones(resp.size, bool), reward=score(task, resp), source=source,
                   group_id=gid, index_in_group=i, versions=(version,), image_ids=ids)
        for i, (resp, lp) in enumerate(outs[k * n:(k + 1) * n])], images))
  return groups
