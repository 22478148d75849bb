"""Synthetic image tasks with verifiable rewards, generated from a seed (no downloads).

The multimodal analogue of `tasks.py`: each task is a short prompt plus a float32
image [S, S, 3] in [0, 1] (S = `image_size`, any multiple of 8 that is >= 16).
Images are a dark, slightly noisy background with filled shapes (squares, discs,
upward triangles) in saturated palette colours, so a pixel belongs to a shape iff
its largest channel is above 0.5.

Vocabulary (same 64 ids as `tasks.py`): 0 PAD, 1 EOS (the stop token), 2 BOS,
3-5 task markers (COLOUR, COUNT, WHERE), 6 SEP, 16-31 the digits 0-15, and 32-37
the colour names RED, GREEN, BLUE, YELLOW, MAGENTA, CYAN. Every prompt is
BOS <marker> SEP (PROMPT_LEN = 3). Every task scores in [0, 1] with partial
credit. `stop` below is 1 if the response is exactly the answer token followed
by EOS (i.e. EOS right after the first token), else 0.7; `a` is the first
response token.

  colour  one large shape in one palette colour c. Answer: the colour name of c,
          then EOS. reward = 1 x stop if a is that colour name; 0.3 if a is another
          colour name; 0 otherwise.
  count   k small shapes, k in 1..6, random kinds and colours (repeats allowed),
          one per cell of a 3x3 grid with >= 2 background pixels between shapes.
          Answer: the digit k, then EOS. reward = max(0, 1 - |a - k| / 4) x stop
          if a is a digit (its value), else 0.
  where   one shape lying entirely inside quadrant q, numbered row-major:
          0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right. Answer: the
          digit q, then EOS. reward = 1 x stop if a is q; 0.5 x stop if a is a
          quadrant sharing an edge with q (q xor a in {1, 2}); 0 for the opposite
          quadrant, any other digit, or a non-digit.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from knittrans_jax.rollout.tasks import BOS, DIGIT0, EOS, PAD, SEP, digit  # noqa: F401

# Task markers reuse the text suite's marker ids 3-5 (one per vision source).
COLOUR, COUNT, WHERE = 3, 4, 5
RED, GREEN, BLUE, YELLOW, MAGENTA, CYAN = 32, 33, 34, 35, 36, 37
COLOUR0 = RED
COLOUR_NAMES = ("red", "green", "blue", "yellow", "magenta", "cyan")
# RGB of each colour name, in token order. Every max channel is >= 0.85 and the
# background stays below ~0.25, so thresholding at 0.5 separates them.
PALETTE = np.array([
    [0.90, 0.12, 0.12],
    [0.12, 0.85, 0.15],
    [0.15, 0.25, 0.95],
    [0.95, 0.90, 0.12],
    [0.90, 0.12, 0.90],
    [0.12, 0.90, 0.90],
], np.float32)
NUM_COLOURS = len(COLOUR_NAMES)
VOCAB_SIZE = 64
SOURCES = ("colour", "count", "where")
IMAGE_SIZE = 32
PROMPT_LEN = 3
SHAPES = ("square", "disc", "triangle")
MAX_COUNT = 6


@dataclasses.dataclass(frozen=True)
class VisionTask:
  source: str
  prompt: np.ndarray  # int32 [PROMPT_LEN]
  image: np.ndarray  # float32 [S, S, 3] in [0, 1]
  answer: dict  # what the scorer checks


def colour_token(c: int) -> int:
  return COLOUR0 + c


def _check_source(source: str) -> None:
  if source not in SOURCES:
    raise ValueError(f"unknown vision task source {source!r}; choose one of {SOURCES}")


def _shape_mask(kind: str, size: int, top: int, left: int, image_size: int) -> np.ndarray:
  """Bool [S, S] mask of a filled shape inside the box [top, top+size) x [left, left+size)."""
  # Pixel centres, so shapes are symmetric within their box.
  y = np.arange(image_size)[:, None] + 0.5
  x = np.arange(image_size)[None, :] + 0.5
  in_box = (y >= top) & (y < top + size) & (x >= left) & (x < left + size)
  cy, cx = top + size / 2, left + size / 2
  if kind == "square":
    return in_box
  if kind == "disc":
    return in_box & ((y - cy) ** 2 + (x - cx) ** 2 <= (size / 2) ** 2)
  if kind == "triangle":
    # Apex at the top centre; each row is a centred interval, widening downwards,
    # so the shape is one connected blob.
    half_width = (y - top) / 2
    return in_box & (np.abs(x - cx) <= half_width)
  raise ValueError(f"unknown shape {kind!r}")


def _background(rng: np.random.Generator, image_size: int) -> np.ndarray:
  base = rng.uniform(0.02, 0.12, size=3)
  return np.broadcast_to(base, (image_size, image_size, 3)).astype(np.float32)


def _finish(rng: np.random.Generator, image: np.ndarray) -> np.ndarray:
  # Mild noise over everything (shapes included), kept small so the 0.5
  # threshold between background and shapes is never crossed.
  noise = rng.normal(0.0, 0.02, size=image.shape)
  return np.clip(image + noise, 0.0, 1.0).astype(np.float32)


def _paint(image: np.ndarray, mask: np.ndarray, c: int) -> None:
  image[mask] = PALETTE[c]


def _random_kind(rng: np.random.Generator) -> str:
  return SHAPES[int(rng.integers(0, len(SHAPES)))]


def _colour_image(rng, S):
  c = int(rng.integers(0, NUM_COLOURS))
  kind = _random_kind(rng)
  size = int(rng.integers(3 * S // 8, 5 * S // 8 + 1))
  top, left = (int(v) for v in rng.integers(1, S - size, size=2))
  image = _background(rng, S).copy()
  _paint(image, _shape_mask(kind, size, top, left, S), c)
  return image, {"colour": c, "token": colour_token(c)}


def _count_image(rng, S):
  k = int(rng.integers(1, MAX_COUNT + 1))
  # One shape per cell of a 3x3 grid, with a 1-pixel margin inside each cell,
  # so shapes never touch (>= 2 background pixels between neighbours).
  cell = S // 3
  lo, hi = max(3, cell // 3), min(cell - 2, max(3, 2 * cell // 3))
  cells = rng.choice(9, size=k, replace=False)
  image = _background(rng, S).copy()
  for idx in cells:
    row, col = divmod(int(idx), 3)
    size = int(rng.integers(lo, hi + 1))
    top = row * cell + int(rng.integers(1, cell - size))
    left = col * cell + int(rng.integers(1, cell - size))
    c = int(rng.integers(0, NUM_COLOURS))
    _paint(image, _shape_mask(_random_kind(rng), size, top, left, S), c)
  return image, {"k": k}


def _where_image(rng, S):
  q = int(rng.integers(0, 4))
  qy, qx = divmod(q, 2)
  half = S // 2
  size = int(rng.integers(max(3, S // 8), S // 4 + 1))
  # Keep a 1-pixel margin from the quadrant's edges so the shape is wholly inside.
  top = qy * half + int(rng.integers(1, half - size))
  left = qx * half + int(rng.integers(1, half - size))
  c = int(rng.integers(0, NUM_COLOURS))
  image = _background(rng, S).copy()
  _paint(image, _shape_mask(_random_kind(rng), size, top, left, S), c)
  return image, {"q": q}


_MARKERS = {"colour": COLOUR, "count": COUNT, "where": WHERE}
_MAKERS = {"colour": _colour_image, "count": _count_image, "where": _where_image}


def make_task(rng: np.random.Generator, source: str, image_size: int = IMAGE_SIZE) -> VisionTask:
  _check_source(source)
  if image_size < 16 or image_size % 8:
    raise ValueError(f"image_size must be a multiple of 8 and >= 16, got {image_size}")
  image, answer = _MAKERS[source](rng, image_size)
  image = _finish(rng, image)
  prompt = np.array([BOS, _MARKERS[source], SEP], np.int32)
  return VisionTask(source, prompt, image, answer)


def _first(response: np.ndarray) -> tuple[int | None, float]:
  """First response token (None if empty or EOS) and the stop factor."""
  response = np.asarray(response).reshape(-1)
  if response.size == 0 or response[0] == EOS:
    return None, 0.0
  stops_right_after = response.size >= 2 and response[1] == EOS
  return int(response[0]), (1.0 if stops_right_after else 0.7)


def _as_digit(tok: int | None) -> int | None:
  if tok is None or not DIGIT0 <= tok < DIGIT0 + 16:
    return None
  return tok - DIGIT0


def score(task: VisionTask, response: np.ndarray) -> float:
  _check_source(task.source)
  a, stop = _first(response)
  if task.source == "colour":
    if a == task.answer["token"]:
      return stop
    return 0.3 if a is not None and COLOUR0 <= a < COLOUR0 + NUM_COLOURS else 0.0
  value = _as_digit(a)
  if value is None:
    return 0.0
  if task.source == "count":
    return max(0.0, 1.0 - abs(value - task.answer["k"]) / 4.0) * stop
  # where
  q = task.answer["q"]
  if value == q:
    return stop
  if value < 4 and (value ^ q) in (1, 2):
    return 0.5 * stop
  return 0.0
