"""One GRPO group: a task from its seed, n sampled responses, scored trajectories.

Four task suites: 'text' (rollout/tasks.py), 'vision' (rollout/vision_tasks.py,
one generated image per prompt, shared by the group's n responses: the sampler
encodes it once and the group stores it once), 'math' (rollout/math_tasks.py: a
prompt data set through a real tokenizer, the verifiable math reward) and 'agentic'
(rollout/agentic_tasks.py: multi-turn episodes, each in its own environment, run by
the agent loop, rollout/agent_loop.py). The math suite needs its `MathSource`
(config, tokenizer directory), passed as `math`; the agentic suite its
`AgentSource` (the tasks' and the loop's configs), passed as `agent`.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from knittrans_jax.data import split
from knittrans_jax.models.vision_spec import VisionSpec
from knittrans_jax.rollout import agentic_tasks, math_tasks, tasks, vision_tasks
from knittrans_jax.rollout.agent_loop import AgentConfig, AgentLoop, EpisodeGroup, FailedGroup
from knittrans_jax.rollout.qwen_vision_tasks import QwenVisionTasks
from knittrans_jax.rollout.engine import (EngineSpec, FinishedGroup, GroupRequest, PromptSpec,
                                          ToolInsert, response_seeds)
from knittrans_jax.rollout.jax_engine import JaxEngine, generate_groups
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.storage import Image
from knittrans_jax.types import Trajectory

PROMPT_LEN = 5  # the longest text prompt; prompts are left-padded to it
SUITES = ("text", "vision", "math", "agentic")


@dataclasses.dataclass(frozen=True)
class MathSource:
  """What a process needs to build the math suite (picklable, sent to workers)."""
  config: math_tasks.MathTaskConfig
  tokenizer_dir: str
  seed: int = 0

  def suite(self) -> math_tasks.MathTasks:
    return math_tasks.suite_for(self.config, self.tokenizer_dir, self.seed)


@dataclasses.dataclass(frozen=True)
class AgentSource:
  """What a process needs to run the agentic suite (picklable, sent to workers): the
  tasks' config (turn tail, tool latency) and the agent loop's (turns, token budget,
  step timeout), both as the root binds them (job/setup.py's job_setup)."""
  tasks: agentic_tasks.AgenticTaskConfig
  loop: AgentConfig


def suite_sources(suite: str, math: MathSource | None = None) -> tuple[str, ...]:
  if _check(suite, math) == "math":
    return math.suite().sources
  return {"text": tasks.SOURCES, "vision": vision_tasks.SOURCES,
          "agentic": agentic_tasks.SOURCES}[suite]


def suite_prompt_len(suite: str, math: MathSource | None = None) -> int:
  if _check(suite, math) == "math":
    return math.config.prompt_len
  return {"text": PROMPT_LEN, "vision": vision_tasks.PROMPT_LEN,
          "agentic": agentic_tasks.PROMPT_LEN}[suite]


def _check(suite: str, math: MathSource | None = None) -> str:
  if suite not in SUITES:
    raise ValueError(f"task suite {suite!r} is unknown; use one of {SUITES}")
  if suite == "math" and math is None:
    raise ValueError("the 'math' suite needs its MathSource (prompt file and tokenizer)")
  return suite


def task_for(seed: int, group_id: int, source: str, suite: str = "text", image_size: int = 32,
             math: MathSource | None = None, max_draws: int = 1000,
             agent: AgentSource | None = None):
  """The task of a group is a pure function of (seed, group id, source). A training
  group never gets a held-out prompt and an evaluation group (id from
  split.HELD_OUT_GROUP_IDS) only gets held-out ones: a task on the wrong side of the
  split is drawn again from the same generator."""
  if _check(suite, math) == "math":
    return math.suite().task(group_id, source)
  rng = np.random.default_rng([seed, group_id])
  want = split.for_evaluation(group_id)
  for _ in range(max_draws):
    if suite == "vision":
      task = vision_tasks.make_task(rng, source, image_size)
      if split.held_out(source, task.prompt, task.image) == want:
        return task
    elif suite == "agentic":
      if agent is None:
        raise ValueError("the 'agentic' suite's held-out tasks need its AgentSource (the run's "
                         "AgenticTaskConfig: JobSetup.agent)")
      task = agentic_tasks.make_task(rng, source, agent.tasks)
      if agentic_tasks.held_out(task) == want:
        return task
    else:
      task = tasks.make_task(rng, source)
      if split.held_out(source, task.prompt) == want:
        return task
  raise ValueError(f"source {source!r}: no {'held-out' if want else 'training'} prompt in "
                   f"{max_draws} draws (its prompt space has too few prompts for the split)")


@dataclasses.dataclass
class RolledGroup:
  trajectories: list[Trajectory]
  images: list[Image]  # stored once for the whole group (empty for text); id hashed once


@dataclasses.dataclass(frozen=True)
class Suite:
  """A task suite as rollout sees it: a group's task, the engine request of a task
  (engines never see the task: the caller keeps it beside the request), trajectories
  from a finished group and its task. `vision`: the run's vision spec (models/vision_spec.py), which
  the 'vision' suite needs: its images' size, and for a Qwen-VL checkpoint prompts
  that carry the image's pad tokens and the uint8 image the store keeps
  (rollout/qwen_vision_tasks.py)."""
  name: str = "text"
  math: MathSource | None = None
  vision: VisionSpec | None = None
  agent: AgentSource | None = None

  def __post_init__(self):
    _check(self.name, self.math)
    if self.name == "agentic" and self.agent is None:
      raise ValueError("task suite 'agentic' needs its AgentSource (built by the run's set-up, "
                       "job/setup.py: the tasks' and the agent loop's configs)")
    if self.name != "agentic" and self.agent is not None:
      raise ValueError(f"task suite {self.name!r} with an AgentSource: only the 'agentic' suite "
                       "runs episodes")
    if (self.name == "vision") != (self.vision is not None):
      raise ValueError(f"task suite {self.name!r} with vision spec "
                       f"{None if self.vision is None else self.vision.kind!r}: the 'vision' "
                       "suite, and only it, takes one")

  @functools.cached_property
  def qwen(self) -> QwenVisionTasks | None:
    return QwenVisionTasks.of(self.vision)

  @property
  def image_size(self) -> int:
    return self.vision.image_size if self.vision is not None else 0

  @property
  def call_token(self) -> int:
    """The token that calls a multi-turn task's tool (rollout/tasks.py's 'lookup')."""
    return tasks.CALL

  @property
  def prompt_len(self) -> int:
    return self.qwen.prompt_len if self.qwen is not None else suite_prompt_len(self.name, self.math)

  def task(self, seed: int, group_id: int, source: str):
    return task_for(seed, group_id, source, self.name, self.image_size, self.math,
                    agent=self.agent)

  @property
  def multi_turn(self) -> bool:
    """Episodes in environments (the agent loop), not single responses."""
    return self.agent is not None

  def environments(self, task, n: int, group_id: int) -> list:
    """The n environments of a group's episodes (the agentic suite); injected faults
    (AgenticTaskConfig.fault_rate) only in training groups."""
    faults = not split.for_evaluation(group_id)
    return [agentic_tasks.AgenticEnv(task, i, self.agent.tasks, faults) for i in range(n)]

  def agent_loop(self, engine, sampler: SamplerConfig) -> AgentLoop:
    return AgentLoop(engine, self.agent.loop, vocab_size=tasks.VOCAB_SIZE,
                     max_new_tokens=sampler.max_new_tokens)

  def start(self, loop: AgentLoop, task, seed: int, group_id: int, n: int) -> None:
    """Adds group `group_id`'s n episodes to the agent loop."""
    loop.add(group_id, task.source, self.environments(task, n, group_id), task,
             response_seeds(seed, group_id, n))

  def prompt(self, task) -> np.ndarray:
    return self.qwen.prompt(task) if self.qwen is not None else task.prompt

  @property
  def prompt_spec(self) -> PromptSpec:
    """How the JAX engine lays out this suite's prompts (EngineSpec.prompts)."""
    qwen = self.qwen
    return PromptSpec(self.prompt_len, None if qwen is None else qwen.inputs,
                      () if qwen is None else qwen.special_ids)

  def request(self, task, seed: int, group_id: int, n: int) -> GroupRequest:
    """The engine request of group `group_id` (task `task`): its prompt, n seeds, a
    vision group's stored image, what a multi-turn task's tool inserts."""
    image = tool = None
    if self.name == "vision":
      image = self.qwen.stored_image(task) if self.qwen is not None else task.image
    if isinstance(task, tasks.Task) and task.tool_output is not None:
      tool = ToolInsert(self.call_token, np.asarray(task.tool_output, np.int32))
    return GroupRequest(group_id, task.source, np.asarray(self.prompt(task), np.int32), n,
                        response_seeds(seed, group_id, n), image=image, tool=tool)

  def rolled(self, task, group: FinishedGroup | EpisodeGroup) -> RolledGroup:
    """A finished group scored against its task: its trajectories, and its image
    (stored once). An EpisodeGroup's episodes are scored by their environments:
    each is one trajectory, observations masked (AgentLoop's Episode.response)."""
    if isinstance(group, EpisodeGroup):
      return RolledGroup([
          Trajectory(prompt_tokens=ep.prompt, response_tokens=tokens, logprobs=logprobs,
                     loss_mask=mask, reward=ep.reward, source=group.source,
                     group_id=group.group_id, index_in_group=i, versions=ep.versions,
                     turns=ep.turn_spans(), gen_seconds=ep.gen_s, env_seconds=ep.env_s)
          for i, ep in enumerate(group.episodes)
          for tokens, logprobs, mask in [ep.response()]], [])
    req = group.request
    score = ({"vision": vision_tasks.score, "text": tasks.score}.get(self.name)
             or self.math.suite().score)
    images = [Image.of(req.image)] if self.name == "vision" else []  # the only hash of it
    ids = tuple(im.id for im in images)
    return RolledGroup([
        Trajectory(prompt_tokens=req.prompt, response_tokens=r.tokens, logprobs=r.logprobs,
                   # a tool's inserted tokens are context, not the policy's: no loss
                   loss_mask=(np.ones(r.tokens.size, bool) if r.inserted is None
                              else ~np.asarray(r.inserted, bool)),
                   reward=score(task, r.tokens),
                   source=req.source, group_id=req.group_id, index_in_group=i,
                   versions=tuple(sorted(set(r.versions))), image_ids=ids,
                   gen_seconds=group.seconds or 0.0)  # the group's decode time, if timed
        for i, r in enumerate(group.responses)], images)


def rollout_groups(graphdef, params, version: int, seed: int, requests: list[tuple[int, str]],
                   n: int, sampler: SamplerConfig, suite: str = "text",
                   math: MathSource | None = None, vision: VisionSpec | None = None,
                   agent: AgentSource | None = None) -> list[RolledGroup]:
  """Generates n responses for each (group id, source) in one JAX sampler call (the
  colocated reference and held-out evaluation; rollout workers run an engine).

  Response i of group g samples with the key of its seed, a function of (seed, g, i)
  (engine.response_seeds, jax_engine.response_keys), so a group comes out the same
  however groups are batched into calls: a worker's few, the colocated reference's many
  (up to float reassociation in batched matmuls). The agentic suite runs its episodes
  on an agent loop over a JAX engine holding `params`; an environment that fails
  stops this call (the colocated reference and evaluation have no worker to retry).
  """
  tasks_ = Suite(suite, math, vision, agent)
  pairs = [(tasks_.task(seed, gid, source), gid) for gid, source in requests]
  if tasks_.multi_turn:
    engine = JaxEngine(EngineSpec("jax", None, sampler, seed, rows_per_call=len(requests) * n),
                       graphdef, params, version)
    loop = tasks_.agent_loop(engine, sampler)
    try:
      for task, gid in pairs:
        tasks_.start(loop, task, seed, gid, n)
      done = {g.group_id: g for g in loop.run()}
    finally:
      loop.close()
    failed = [g.reason for g in done.values() if isinstance(g, FailedGroup)]
    if failed:
      raise RuntimeError(f"{len(failed)} episode group(s) failed: {failed[0]}")
    return [tasks_.rolled(task, done[gid]) for task, gid in pairs]
  reqs = [tasks_.request(task, seed, gid, n) for task, gid in pairs]
  finished = generate_groups(graphdef, params, version, reqs, sampler, tasks_.prompt_spec)
  return [tasks_.rolled(task, g) for (task, _), g in zip(pairs, finished)]
