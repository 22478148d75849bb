"""Records shared by every component: what a producer appends, what the controller sees.

Plain dataclasses only; no JAX, no TensorStore. The controller works on `TrajMeta`
(metadata), never on payloads.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class TurnSpan:
  """One generated turn of a multi-turn trajectory (an agent episode): its response
  tokens [start, end) (offsets into the response, the observation that follows it
  not included) and the oldest and newest policy versions that generated them."""
  start: int
  end: int
  version_first: int
  version_last: int


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """One finished response, as a rollout worker hands it to its storage unit.

  `logprobs` and `loss_mask` cover the response tokens only; the store aligns them
  with the full sequence (prompt positions get log-prob 0 and mask 0).
  `versions` lists the policy versions that generated it (several if weights changed
  mid-response); v_gen is the oldest.
  An agent episode is one trajectory: its response is every turn and every
  observation in order (observations with loss mask 0), `turns` says where each
  turn lies and which versions generated it, and `gen_seconds` / `env_seconds` the
  wall time its engine requests and its environment steps took. A single
  generation has no turns and, where nobody timed it, zero seconds.
  """
  prompt_tokens: np.ndarray  # [P] integer
  response_tokens: np.ndarray  # [R] integer
  logprobs: np.ndarray  # [R] float, behaviour log-probs
  loss_mask: np.ndarray  # [R] bool or {0, 1}
  reward: float
  source: str
  group_id: int
  index_in_group: int
  versions: Sequence[int]
  image_ids: Sequence[str] = ()
  turns: Sequence[TurnSpan] = ()
  gen_seconds: float = 0.0
  env_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class TrajMeta:
  """Metadata record of one committed trajectory: all the controller ever moves."""
  unit: str
  row: int
  token_start: int  # offset of the sequence in the unit's jagged token arrays
  prompt_len: int
  response_len: int
  source: str
  group_id: int
  index_in_group: int
  version_first: int  # v_gen: oldest version that generated a token
  version_last: int
  reward: float
  image_ids: tuple[str, ...] = ()
  # Response tokens with loss mask 1 (the store counts them); None: every response
  # token (metadata made without a store).
  loss_tokens: int | None = None
  # An episode's turns (empty: a single generation) and the seconds it spent
  # generating and in its environment (microsecond resolution; 0 where not timed).
  turns: tuple[TurnSpan, ...] = ()
  gen_seconds: float = 0.0
  env_seconds: float = 0.0

  @property
  def id(self) -> str:
    return f"{self.unit}/{self.row}"

  @property
  def trained_tokens(self) -> int:
    """The tokens this trajectory adds to its mini-batch's loss normaliser."""
    return self.response_len if self.loss_tokens is None else self.loss_tokens

  @property
  def length(self) -> int:
    return self.prompt_len + self.response_len

  @property
  def token_end(self) -> int:
    return self.token_start + self.length


@dataclasses.dataclass
class Payload:
  """Payload arrays of a list of trajectories, in the order they were asked for.

  Sequence arrays are full-length (prompt + response); images are keyed by image id
  and appear once however many trajectories share them.
  """
  metas: list[TrajMeta]
  tokens: list[np.ndarray]
  logprobs: list[np.ndarray]
  loss_mask: list[np.ndarray]
  images: dict[str, np.ndarray]
  # Image bytes the read moved: more than `images` holds when the store keeps a copy
  # per trajectory and each was read (None: as many as `images` holds).
  image_bytes_read: int | None = None

  @property
  def nbytes(self) -> int:
    return self._seq_nbytes() + sum(a.nbytes for a in self.images.values())

  @property
  def nbytes_read(self) -> int:
    """Bytes the read moved (every image copy counted)."""
    return self._seq_nbytes() + self.image_nbytes_read

  @property
  def image_nbytes_read(self) -> int:
    """Image bytes the read moved (every image copy counted)."""
    if self.image_bytes_read is None:
      return sum(a.nbytes for a in self.images.values())
    return self.image_bytes_read

  def _seq_nbytes(self) -> int:
    return sum(a.nbytes for arrs in (self.tokens, self.logprobs, self.loss_mask) for a in arrs)


@dataclasses.dataclass(frozen=True)
class GroupInfo:
  """A finished GRPO group as admission sees it: metadata only.

  `version` is the group's v_gen, the oldest policy version that generated any of
  its trajectories. `metas` optionally carries the trajectories' store records so
  the data plane can plan reads; admission never looks at them.
  """
  group_id: int
  source: str
  num_tokens: int
  version: int
  rewards: tuple[float, ...] = ()
  metas: tuple[TrajMeta, ...] = ()

  @classmethod
  def from_metas(cls, metas) -> "GroupInfo":
    """A finished group from its trajectories' store records (one group, in order)."""
    return cls(group_id=metas[0].group_id, source=metas[0].source,
               num_tokens=sum(m.length for m in metas),
               version=min(m.version_first for m in metas),
               rewards=tuple(m.reward for m in metas), metas=tuple(metas))

  @property
  def zero_signal(self) -> bool:
    """All rewards equal: group-normalised advantages are all zero."""
    return len(self.rewards) > 0 and min(self.rewards) == max(self.rewards)


@dataclasses.dataclass(frozen=True)
class MiniBatch:
  """Mini-batch `index` (j) of train batch `train_batch` (k): one optimizer step."""
  train_batch: int
  index: int
  groups: tuple[GroupInfo, ...]
  admitted_version: int

  @property
  def num_tokens(self) -> int:
    return sum(g.num_tokens for g in self.groups)

  def count(self, source: str) -> int:
    return sum(g.source == source for g in self.groups)
