"""Prompt data sets: JSONL files of prompts, each with a source and an answer.

    {"id": "arith-00017", "source": "add", "prompt": "Ana has 12 apples ...", "answer": "29"}

One JSON object per line; `id`, `source`, `prompt` and `answer` are strings, other
fields are kept in `extra`. `PromptSet` groups the prompts by source; the prompt of
a group is a pure function of (seed, group id, source), as the synthetic tasks'
are (rollout/groups.task_for), so a resumed or replayed run sees the same prompt
for the same group. The job's quota-exact stream (admission/dispatch.py)
decides the sources; this decides the prompt within a source.

Pure Python; no JAX.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Sequence

import numpy as np

from knittrans_jax.data import split

FIELDS = ("id", "source", "prompt", "answer")


class PromptDataError(ValueError):
  """A prompt file or record that cannot be used; names the file, line and field."""


@dataclasses.dataclass(frozen=True)
class Prompt:
  id: str
  source: str
  prompt: str
  answer: str
  extra: dict = dataclasses.field(default_factory=dict, compare=False)


def load_prompts(path: str) -> list[Prompt]:
  """Every record of a JSONL file; ids must be unique."""
  if not os.path.exists(path):
    raise PromptDataError(f"prompt file {path} does not exist")
  out, seen = [], {}
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise PromptDataError(f"{path} line {n} is not JSON ({e.msg}): {line[:80]!r}") from None
      if not isinstance(rec, dict):
        raise PromptDataError(f"{path} line {n}: a record is a JSON object, got {type(rec).__name__}")
      for field in FIELDS:
        if field not in rec:
          raise PromptDataError(f"{path} line {n}: field {field!r} is missing (record id "
                                f"{rec.get('id')!r})")
        if not isinstance(rec[field], str) or not rec[field].strip():
          raise PromptDataError(f"{path} line {n}: field {field!r} = {rec[field]!r} must be a "
                                "non-empty string")
      if rec["id"] in seen:
        raise PromptDataError(f"{path} line {n}: id {rec['id']!r} already used on line "
                              f"{seen[rec['id']]}")
      seen[rec["id"]] = n
      out.append(Prompt(rec["id"], rec["source"], rec["prompt"], rec["answer"],
                        {k: v for k, v in rec.items() if k not in FIELDS}))
  if not out:
    raise PromptDataError(f"prompt file {path} holds no records")
  return out


class PromptSet:
  """Prompts by source; `prompt_for(group_id, source)` picks one deterministically."""

  def __init__(self, prompts: Iterable[Prompt], seed: int = 0,
               sources: Sequence[str] | None = None):
    self.seed = seed
    self._sides: dict[tuple[str, bool], list[Prompt]] = {}
    self.by_source: dict[str, list[Prompt]] = {}
    for p in prompts:
      self.by_source.setdefault(p.source, []).append(p)
    if sources is not None:
      missing = [s for s in sources if s not in self.by_source]
      if missing:
        raise PromptDataError(f"sources {missing} have no prompts; the file has "
                              f"{sorted(self.by_source)}")

  @classmethod
  def from_file(cls, path: str, seed: int = 0, sources: Sequence[str] | None = None):
    return cls(load_prompts(path), seed, sources)

  @property
  def sources(self) -> tuple[str, ...]:
    return tuple(sorted(self.by_source))

  def _side(self, source: str, held_out: bool) -> list[Prompt]:
    """The prompts of `source` on one side of the held-out split (data/split.py)."""
    key = (source, held_out)
    if key not in self._sides:
      pool = [p for p in self.by_source[source] if split.held_out(source, p.prompt) == held_out]
      if not pool:
        raise PromptDataError(
            f"source {source!r}: none of its {len(self.by_source[source])} prompts is on the "
            f"{'held-out' if held_out else 'training'} side of the split (one in "
            f"{split.FRACTION} is held out, by content); give the source more prompts")
      self._sides[key] = pool
    return self._sides[key]

  def prompt_for(self, group_id: int, source: str) -> Prompt:
    """A training group's prompt from the training side of the split; an evaluation
    group's (id from split.HELD_OUT_GROUP_IDS) from the held-out side."""
    if source not in self.by_source:
      raise PromptDataError(f"unknown source {source!r}; the prompt set has {list(self.sources)}")
    pool = self._side(source, split.for_evaluation(group_id))
    # Drawn with replacement, seeded by (seed, group id, source): reproducible for
    # a given assignment of group ids, whatever order groups are dispatched in.
    rng = np.random.default_rng([self.seed, group_id, _stable(source)])
    return pool[int(rng.integers(len(pool)))]


def _stable(text: str) -> int:
  """A process-independent integer for a string (Python's hash() is salted)."""
  return int.from_bytes(text.encode("utf-8")[:8].ljust(8, b"\0"), "little")
