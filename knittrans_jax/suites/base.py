"""What every task suite gives the rest of the job (suites/__init__.py picks one).

    suite = suites.build(cfg, ...)          # once, at set-up (job/setup.py)
    task = suite.task(seed, group_id, source)
    suite.start(loop, task, seed, group_id, n)   # n episodes on an AgentLoop
    rolled = suite.rolled(task, episode_group)   # trajectories and the group's images

Rollout always runs episodes on the agent loop (rollout/agent_loop.py): a
single-turn task is an episode of one step, its environment a scorer (`OneStepEnv`)
that the loop calls on its own thread. The trainer takes the common batch (tokens,
masks, advantages, log-probs) and the suite's `batch_fields` (a VLM's images);
`forward` is the model's call on a batch.

A suite is a frozen, picklable value: set-up builds it with its configs and sends
the same value to rollout workers, evaluation and the trainer.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
from flax import nnx

from knittrans_jax.data import split
from knittrans_jax.models import hf
from knittrans_jax.models.vlm import make_model
from knittrans_jax.rollout.agent_loop import AgentConfig, AgentLoop, EpisodeGroup
from knittrans_jax.rollout.engine import GroupRequest, PromptSpec, ToolInsert, response_seeds
from knittrans_jax.rollout.environment import Environment, EnvStep
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.storage import Image
from knittrans_jax.train.step import text_forward
from knittrans_jax.types import Trajectory

MAX_DRAWS = 1000  # draws of a task on the wrong side of the held-out split, at most


@dataclasses.dataclass
class RolledGroup:
  trajectories: list[Trajectory]
  images: list[Image]  # stored once for the whole group (empty for text); id hashed once


class OneStepEnv(Environment):
  """A single-turn task as an environment: the prompt, then one scored response."""
  inline = True  # a pure scorer: the agent loop calls it on its own thread

  def __init__(self, name: str, prompt: np.ndarray, score):
    self.name, self.prompt, self.score = name, prompt, score

  def reset(self, task) -> np.ndarray:
    return self.prompt

  def step(self, response: np.ndarray) -> EnvStep:
    return EnvStep(np.zeros(0, np.int32), float(self.score(response)), True)


class BatchFields:
  """What a suite's model takes beyond the common batch (none, for a text model).
  `prefix_tokens`: positions before each row's text (the tiny VLM's image);
  `row_images`: rows read their own images with the micro-batch (the naive VLM step);
  `shared`: the micro-batches share one input read per mini-batch (encode-once's
  image slots), read by `read_shared`."""
  prefix_tokens: int = 0
  row_images: bool = False
  shared: bool = False

  def check(self, processes: int) -> None:
    pass

  def read_shared(self, seg, read, mine):
    raise NotImplementedError

  def add(self, batch: dict, payload, seg, spans) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class TaskSuite:
  """A task family (module doc). Subclasses set `name`, `sources`, `prompt_len` and
  `draw` (one task from a generator), and score one-step responses (`score`) or give
  their own environments."""
  name: ClassVar[str]
  sources: ClassVar[tuple[str, ...]] = ()
  prompt_len: ClassVar[int] = 0
  vocab_size: ClassVar[int | None] = None  # the tasks' ids, checked against the model's

  # -- set-up -------------------------------------------------------------------------
  def sampler(self, sampler: SamplerConfig) -> SamplerConfig:
    """The run's sampler as this suite needs it (a tokenizer's stop tokens)."""
    return sampler

  def max_sequence_len(self, sampler: SamplerConfig) -> int:
    """The longest trajectory: its prompt and one response."""
    return self.prompt_len + sampler.max_new_tokens

  def longest(self, sampler: SamplerConfig) -> str:
    """What makes the longest trajectory, for an error that names it."""
    return f"prompt {self.prompt_len} + max_new_tokens {sampler.max_new_tokens}"

  def check(self, setup) -> None:
    """The suite's own rules, checked before any process starts (job/setup.py)."""

  @property
  def prompt_spec(self) -> PromptSpec:
    """How the JAX engine lays out this suite's prompts (EngineSpec.prompts)."""
    return PromptSpec(self.prompt_len)

  @property
  def image_size(self) -> int:
    return 0

  @property
  def model_vision(self):
    """The model's vision path (models/vision_spec.py's VisionSpec) or None: text."""
    return None

  @property
  def prefix_tokens(self) -> int:
    """Positions the model's image takes before each row's text (the tiny VLM's)."""
    return 0

  @property
  def decoder_only(self) -> bool:
    """The policy is a decoder (models/flops.py counts its FLOPs)."""
    return self.model_vision is None

  # -- rollout ------------------------------------------------------------------------
  def draw(self, rng: np.random.Generator, source: str):
    raise NotImplementedError

  def held_out(self, task) -> bool:
    return split.held_out(task.source, task.prompt)

  def task(self, seed: int, group_id: int, source: str):
    """A group's task, a pure function of (seed, group id, source). A training group
    never gets a held-out prompt and an evaluation group (id from
    split.HELD_OUT_GROUP_IDS) only gets held-out ones: a task on the wrong side of
    the split is drawn again from the same generator."""
    rng = np.random.default_rng([seed, group_id])
    want = split.for_evaluation(group_id)
    for _ in range(MAX_DRAWS):
      task = self.draw(rng, source)
      if self.held_out(task) == want:
        return task
    raise ValueError(f"source {source!r}: no {'held-out' if want else 'training'} prompt in "
                     f"{MAX_DRAWS} draws (its prompt space has too few prompts for the split)")

  def prompt(self, task) -> np.ndarray:
    return task.prompt

  def score(self, task, response: np.ndarray) -> float:
    raise NotImplementedError

  def environments(self, task, n: int, group_id: int) -> list[Environment]:
    """The n environments of a group's episodes: one-step scorers, by default."""
    prompt = np.asarray(self.prompt(task), np.int32)
    return [OneStepEnv(self.name, prompt, lambda r, t=task: self.score(t, r)) for _ in range(n)]

  def loop_config(self, sampler: SamplerConfig) -> AgentConfig:
    """A single-turn task's episodes: one turn after the prompt."""
    return AgentConfig(max_turns=1, max_tokens=self.max_sequence_len(sampler))

  def agent_loop(self, engine, sampler: SamplerConfig) -> AgentLoop:
    return AgentLoop(engine, self.loop_config(sampler), vocab_size=self.vocab_size,
                     max_new_tokens=sampler.max_new_tokens)

  def stored_image(self, task) -> np.ndarray | None:
    """The image a group's requests carry and the store keeps once (None: text)."""
    return None

  def tool(self, task) -> ToolInsert | None:
    """What the engine inserts when a response calls the task's tool (None: no tool)."""
    return None

  def request(self, task, seed: int, group_id: int, n: int) -> GroupRequest:
    """A whole group as one engine request: for a caller that drives an engine without
    the agent loop (a benchmark of the engine alone, a parity test)."""
    return GroupRequest(group_id, task.source, np.asarray(self.prompt(task), np.int32), n,
                        response_seeds(seed, group_id, n), image=self.stored_image(task),
                        tool=self.tool(task))

  def start(self, loop: AgentLoop, task, seed: int, group_id: int, n: int) -> None:
    """Adds group `group_id`'s n episodes to the agent loop."""
    loop.add(group_id, task.source, self.environments(task, n, group_id), task,
             response_seeds(seed, group_id, n), image=self.stored_image(task),
             tool=self.tool(task))

  def rolled(self, task, group: EpisodeGroup) -> RolledGroup:
    """A finished group's trajectories, and its image (stored once, hashed once).
    One-step episodes keep no turn spans (a trajectory with turns is an episode in
    metrics.jsonl); their time is the engine's (`seconds`)."""
    # The image the group's requests carried (made once, in `start`), hashed once here.
    images = [Image.of(group.image)] if group.image is not None else []
    ids, seconds = tuple(im.id for im in images), self.seconds(group) or 0.0
    out = []
    for i, ep in enumerate(group.episodes):
      tokens, logprobs, mask = ep.response()
      out.append(Trajectory(
          prompt_tokens=ep.prompt, response_tokens=tokens, logprobs=logprobs, loss_mask=mask,
          reward=ep.reward, source=group.source, group_id=group.group_id, index_in_group=i,
          versions=ep.versions, image_ids=ids, gen_seconds=seconds))
    return RolledGroup(out, images)

  def seconds(self, group: EpisodeGroup) -> float | None:
    """A group's time in the engine, which dispatch learns from: its one call's
    decode time (None when that call compiled)."""
    times = [t.engine_s for ep in group.episodes for t in ep.turns]
    return None if not times or any(t is None for t in times) else max(times)

  # -- the model and the trainer ---------------------------------------------------------
  def make_model(self, lm, rngs: nnx.Rngs) -> nnx.Module:
    """The policy (models/vlm.py's make_model: the decoder, here)."""
    return make_model(lm, self.model_vision, rngs)

  def load(self):
    """How a Hugging Face checkpoint is read into the policy (models/hf.py's load)."""
    return hf.load

  def forward(self):
    """The model's call on a batch (train/step.py's text_forward, here)."""
    return text_forward

  def check_step(self, setup, model_fn) -> None:
    """The trainer's step rules for this model, before its state is built."""

  def train_parts(self, fns, layout, setup):
    """(BatchFields, a mini-batch step or None): a text model takes the common batch
    and steps micro-batch by micro-batch."""
    return BatchFields(), None


def episode_trajectories(group: EpisodeGroup) -> list[Trajectory]:
  """Multi-turn episodes as trajectories: turn spans and environment time kept."""
  return [Trajectory(prompt_tokens=ep.prompt, response_tokens=tokens, logprobs=logprobs,
                     loss_mask=mask, reward=ep.reward, source=group.source,
                     group_id=group.group_id, index_in_group=i, versions=ep.versions,
                     turns=ep.turn_spans(), gen_seconds=ep.gen_s, env_seconds=ep.env_s)
          for i, ep in enumerate(group.episodes)
          for tokens, logprobs, mask in [ep.response()]]

