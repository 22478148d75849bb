"""Synthetic tasks with verifiable rewards, generated from a seed (no downloads).

Vocabulary (the tiny model's 64 ids): 0 PAD, 1 EOS (the stop token), 2 BOS,
3-5 task markers, 6 SEP, 7 X (a marker the `count` task asks for), 16-31 the
digits 0-15. Every task scores in [0, 1] with partial credit, so a randomly
initialised policy already sees reward differences within a group.

  nearest  (short answers)  prompt: BOS NEAR d SEP. Answer: the digit d, then EOS.
           reward = max(0, 1 - |a - d| / 8) for the first response token a if it is a
           digit (else 0), times 1 if the answer stops right after it, else 0.7.
  count    (medium)         prompt: BOS COUNT n SEP, n in 2..9. Answer: n X tokens,
           then EOS. reward = 0.5 exp(-|len - n| / 3) + 0.5 (X tokens among the
           first n) / n, where len is the response length before EOS.
  chain    (long-tailed)    prompt: BOS CHAIN a L SEP, L in 2..15 drawn with a long
           tail. Answer: the digits a, a+1, ... (mod 16), L of them, then EOS.
           reward = (correct digits among the first L) / L x exp(-|len - L| / 4).
  chain_long  (long)        the chain task with L in 6..15 around 11: the long source
           of configs/text_grpo_tails.gin, whose groups take several times as long
           to decode as `nearest`'s (as a code or proof source does beside chat).
  long     (long-tailed, up to 512 tokens)  prompt: BOS LONG a h SEP. Answer: the chain
           a, a+1, ... (mod 16), L = LONG_LENGTHS[h] digits long (16 to 512,
           geometric in h), then EOS; h is drawn with P(h) ~ exp(-h / 3), so most
           answers are a few dozen tokens and about one in a hundred is several
           hundred (configs/text_long_tails.gin). reward = (correct digits among the
           first L) / L x exp(-|len - L| / (L / 4)).
  lookup   (multi-turn, a tool call)  prompt: BOS LOOKUP k SEP. The value v of key k
           is in a table only the tool holds (TABLE). Answer: CALL; the engine then
           inserts the tool's output RESULT v (context, not sampled: loss mask 0);
           then the digit v, then EOS. reward = closeness of the answer digit
           max(0, 1 - |a - v| / 8), times 0.7 unless it stops right after, halved for
           an answer given without calling the tool (the first response token).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

PAD, EOS, BOS, NEAR, COUNT, CHAIN, SEP, X = 0, 1, 2, 3, 4, 5, 6, 7
LOOKUP, CALL, RESULT = 8, 9, 10
LONG = 12
DIGIT0 = 16
VOCAB_SIZE = 64
SOURCES = ("nearest", "count", "chain", "chain_long", "lookup", "long")
LONG_LENGTHS = tuple(int(round(16 * 32 ** (h / 15))) for h in range(16))  # 16 .. 512
_LONG_P = np.exp(-np.arange(16) / 3.0) / np.exp(-np.arange(16) / 3.0).sum()
TABLE = tuple(int(v) for v in np.random.default_rng(20261202).permutation(16))  # the tool's


@dataclasses.dataclass(frozen=True)
class Task:
  source: str
  prompt: np.ndarray  # int32
  answer: dict  # what the scorer checks
  tool_output: np.ndarray | None = None  # what the engine inserts after CALL (int32)


def digit(d: int) -> int:
  return DIGIT0 + d


def make_task(rng: np.random.Generator, source: str) -> Task:
  if source == "nearest":
    d = int(rng.integers(0, 16))
    return Task(source, np.array([BOS, NEAR, digit(d), SEP], np.int32), {"d": d})
  if source == "count":
    n = int(rng.integers(2, 10))
    return Task(source, np.array([BOS, COUNT, digit(n), SEP], np.int32), {"n": n})
  if source in ("chain", "chain_long"):
    a = int(rng.integers(0, 16))
    if source == "chain":
      L = int(np.clip(np.round(rng.lognormal(np.log(4), 0.6)), 2, 15))
    else:
      L = int(np.clip(np.round(rng.lognormal(np.log(11), 0.25)), 6, 15))
    return Task(source, np.array([BOS, CHAIN, digit(a), digit(L), SEP], np.int32),
                {"a": a, "L": L})
  if source == "long":
    a, h = int(rng.integers(0, 16)), int(rng.choice(16, p=_LONG_P))
    return Task(source, np.array([BOS, LONG, digit(a), digit(h), SEP], np.int32),
                {"a": a, "L": LONG_LENGTHS[h]})
  if source == "lookup":
    k = int(rng.integers(0, 16))
    return Task(source, np.array([BOS, LOOKUP, digit(k), SEP], np.int32), {"v": TABLE[k]},
                tool_output=np.array([RESULT, digit(TABLE[k])], np.int32))
  raise ValueError(f"unknown task source {source!r}; choose one of {SOURCES}")


def answer_body(response: np.ndarray) -> tuple[np.ndarray, bool]:
  """Response tokens before the first EOS, and whether an EOS was emitted."""
  stops = np.flatnonzero(response == EOS)
  return (response[:stops[0]], True) if stops.size else (response, False)


def score(task: Task, response: np.ndarray) -> float:
  body, stopped = answer_body(np.asarray(response))
  if task.source == "nearest":
    d = task.answer["d"]
    if body.size == 0 or not DIGIT0 <= body[0] < DIGIT0 + 16:
      return 0.0
    closeness = max(0.0, 1.0 - abs(int(body[0]) - DIGIT0 - d) / 8.0)
    return closeness * (1.0 if (stopped and body.size == 1) else 0.7)
  if task.source == "count":
    n = task.answer["n"]
    xs = int(np.sum(body[:n] == X))
    return 0.5 * math.exp(-abs(body.size - n) / 3.0) + 0.5 * xs / n
  if task.source in ("chain", "chain_long", "long"):
    a, L = task.answer["a"], task.answer["L"]
    want = DIGIT0 + (a + np.arange(L)) % 16
    got = body[:L]
    correct = int(np.sum(got == want[:got.size]))
    scale = L / 4.0 if task.source == "long" else 4.0
    return correct / L * math.exp(-abs(body.size - L) / scale)
  if task.source == "lookup":
    called = body.size >= 3 and body[0] == CALL and (body[1:3] == task.tool_output).all()
    rest = body[3:] if called else body
    if rest.size == 0 or not DIGIT0 <= rest[0] < DIGIT0 + 16:
      return 0.0
    closeness = max(0.0, 1.0 - abs(int(rest[0]) - DIGIT0 - task.answer["v"]) / 8.0)
    return closeness * (1.0 if (stopped and rest.size == 1) else 0.7) * (1.0 if called else 0.5)
  raise ValueError(f"unknown task source {task.source!r}")
