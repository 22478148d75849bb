"""The 'agentic' suite: multi-turn tool episodes (rollout/agentic_tasks.py), each in
its own environment on the agent loop's threads, with heavy-tailed turn counts and
tool latencies."""
from __future__ import annotations

import dataclasses

import numpy as np

from knittrans_jax.data import split
from knittrans_jax.rollout import agentic_tasks, tasks
from knittrans_jax.rollout.agent_loop import AgentConfig, EpisodeGroup
from knittrans_jax.rollout.engine import PromptSpec
from knittrans_jax.rollout.sampler import SamplerConfig
from knittrans_jax.suites.base import RolledGroup, TaskSuite, episode_trajectories


@dataclasses.dataclass(frozen=True)
class AgenticSuite(TaskSuite):
  """`tasks`: the turn tail, tool latency and fault injection; `loop`: the agent
  loop's turns, token budget and step timeout (both as the root binds them)."""
  tasks: agentic_tasks.AgenticTaskConfig
  loop: AgentConfig
  name = "agentic"
  sources = agentic_tasks.SOURCES
  prompt_len = agentic_tasks.PROMPT_LEN
  vocab_size = tasks.VOCAB_SIZE

  def max_sequence_len(self, sampler: SamplerConfig) -> int:
    """An episode's context is at most AgentConfig.max_tokens."""
    return self.loop.max_tokens

  def longest(self, sampler: SamplerConfig) -> str:
    return f"AgentConfig.max_tokens = {self.loop.max_tokens}, an episode's longest context"

  def check(self, setup) -> None:
    """Budgets and fault injection, checked before any worker starts."""
    loop, cfg, sampler = self.loop, self.tasks, setup.sampler
    if loop.max_tokens < self.prompt_len + sampler.max_new_tokens:
      raise ValueError(f"AgentConfig.max_tokens = {loop.max_tokens} cannot hold a prompt of "
                       f"{self.prompt_len} and one turn of SamplerConfig.max_new_tokens = "
                       f"{sampler.max_new_tokens}")
    if cfg.fault_rate and cfg.hang_s <= loop.step_timeout_s:
      raise ValueError(f"AgenticTaskConfig.hang_s = {cfg.hang_s:g} must exceed "
                       f"AgentConfig.step_timeout_s = {loop.step_timeout_s:g}: an injected hang "
                       "must time out")
    if cfg.fault_rate and setup.cfg.mode == "colocated":
      raise ValueError("AgenticTaskConfig.fault_rate with JobConfig.mode = 'colocated': the "
                       "colocated generator has no worker to replace a failed group (a failed "
                       "environment stops it); inject faults in the other modes")

  @property
  def prompt_spec(self) -> PromptSpec:
    """Contexts grow every turn: the engine pads each call to a few lengths."""
    return PromptSpec()

  def draw(self, rng: np.random.Generator, source: str):
    return agentic_tasks.make_task(rng, source, self.tasks)

  def held_out(self, task) -> bool:
    return agentic_tasks.held_out(task)

  def environments(self, task, n: int, group_id: int) -> list:
    """Injected faults (AgenticTaskConfig.fault_rate) only in training groups."""
    faults = not split.for_evaluation(group_id)
    return [agentic_tasks.AgenticEnv(task, i, self.tasks, faults) for i in range(n)]

  def loop_config(self, sampler: SamplerConfig) -> AgentConfig:
    return self.loop

  def rolled(self, task, group: EpisodeGroup) -> RolledGroup:
    return RolledGroup(episode_trajectories(group), [])

  def seconds(self, group: EpisodeGroup) -> float | None:
    """From the group's start to its last episode's end, environments included."""
    return group.seconds
