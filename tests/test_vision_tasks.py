"""Vision tasks: images are deterministic and match their answers; scores follow the docstring."""
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from knittrans_jax.rollout import vision_tasks as vt

EOS = vt.EOS


def _foreground(image):
  # Shapes use saturated colours (max channel >= 0.85); the background stays dark.
  return image.max(axis=-1) > 0.5


def _blobs(mask):
  """Connected components (4-neighbour BFS) of a bool mask, as lists of (y, x)."""
  seen = np.zeros_like(mask)
  blobs = []
  H, W = mask.shape
  for y0, x0 in zip(*np.nonzero(mask)):
    if seen[y0, x0]:
      continue
    seen[y0, x0] = True
    queue, blob = deque([(y0, x0)]), []
    while queue:
      y, x = queue.popleft()
      blob.append((y, x))
      for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
        if 0 <= ny < H and 0 <= nx < W and mask[ny, nx] and not seen[ny, nx]:
          seen[ny, nx] = True
          queue.append((ny, nx))
    blobs.append(blob)
  return blobs


def _tasks(source, n, seed=0, image_size=vt.IMAGE_SIZE):
  rng = np.random.default_rng(seed)
  return [vt.make_task(rng, source, image_size) for _ in range(n)]


@pytest.mark.parametrize("source", vt.SOURCES)
def test_same_seed_same_task(source):
  a = vt.make_task(np.random.default_rng(7), source)
  b = vt.make_task(np.random.default_rng(7), source)
  np.testing.assert_array_equal(a.image, b.image)
  np.testing.assert_array_equal(a.prompt, b.prompt)
  assert a.answer == b.answer and a.source == b.source == source
  c = vt.make_task(np.random.default_rng(8), source)
  assert not np.array_equal(a.image, c.image)


@pytest.mark.parametrize("source", vt.SOURCES)
@pytest.mark.parametrize("size", [16, 32, 64])
def test_image_and_prompt_format(source, size):
  for t in _tasks(source, 5, image_size=size):
    assert t.image.dtype == np.float32 and t.image.shape == (size, size, 3)
    assert 0.0 <= t.image.min() and t.image.max() <= 1.0
    assert t.prompt.dtype == np.int32 and t.prompt.shape == (vt.PROMPT_LEN,)
    assert t.prompt[0] == vt.BOS and t.prompt[-1] == vt.SEP
  markers = {vt.make_task(np.random.default_rng(0), s).prompt[1] for s in vt.SOURCES}
  assert len(markers) == len(vt.SOURCES)


def test_large_image():
  t = vt.make_task(np.random.default_rng(0), "where", image_size=448)
  assert t.image.dtype == np.float32 and t.image.shape == (448, 448, 3)
  assert 0.0 <= t.image.min() and t.image.max() <= 1.0


def test_bad_image_size_raises():
  with pytest.raises(ValueError, match="image_size"):
    vt.make_task(np.random.default_rng(0), "colour", image_size=20)


@pytest.mark.parametrize("size", [16, 32, 64])
def test_count_image_has_k_separate_shapes(size):
  ks = set()
  for t in _tasks("count", 60, seed=1, image_size=size):
    assert len(_blobs(_foreground(t.image))) == t.answer["k"]
    ks.add(t.answer["k"])
  assert ks == set(range(1, vt.MAX_COUNT + 1))


def test_colour_image_dominant_colour_is_the_answer():
  seen = set()
  for t in _tasks("colour", 30, seed=2):
    fg = _foreground(t.image)
    assert fg.sum() > 0.05 * fg.size  # a large shape
    mean = t.image[fg].mean(axis=0)
    nearest = int(np.argmin(((vt.PALETTE - mean) ** 2).sum(-1)))
    assert nearest == t.answer["colour"]
    assert t.answer["token"] == vt.colour_token(nearest)
    seen.add(nearest)
  assert len(seen) == vt.NUM_COLOURS


@pytest.mark.parametrize("size", [16, 32])
def test_where_shape_lies_in_the_answer_quadrant(size):
  seen = set()
  for t in _tasks("where", 30, seed=3, image_size=size):
    ys, xs = np.nonzero(_foreground(t.image))
    assert ys.size > 0
    cy, cx = ys.mean(), xs.mean()
    q = 2 * int(cy >= size / 2) + int(cx >= size / 2)
    assert q == t.answer["q"]
    # The whole shape, not just its centroid, stays in the quadrant.
    assert len({2 * int(y >= size / 2) + int(x >= size / 2) for y, x in zip(ys, xs)}) == 1
    seen.add(q)
  assert seen == {0, 1, 2, 3}


def _task(source, answer):
  return vt.VisionTask(source, np.zeros(3, np.int32), np.zeros((16, 16, 3), np.float32), answer)


def test_colour_scores():
  t = _task("colour", {"colour": 2, "token": vt.BLUE})
  assert vt.score(t, np.array([vt.BLUE, EOS])) == 1.0
  assert vt.score(t, np.array([vt.BLUE, EOS, 9, 9])) == 1.0  # tokens after EOS are ignored
  assert vt.score(t, np.array([vt.BLUE, vt.BLUE, EOS])) == pytest.approx(0.7)
  assert vt.score(t, np.array([vt.BLUE])) == pytest.approx(0.7)
  assert vt.score(t, np.array([vt.RED, EOS])) == pytest.approx(0.3)
  assert vt.score(t, np.array([vt.digit(2), EOS])) == 0.0
  assert vt.score(t, np.array([EOS, vt.BLUE])) == 0.0
  assert vt.score(t, np.array([], np.int32)) == 0.0


def test_count_scores():
  t = _task("count", {"k": 3})
  assert vt.score(t, np.array([vt.digit(3), EOS])) == 1.0
  assert vt.score(t, np.array([vt.digit(3), vt.digit(3)])) == pytest.approx(0.7)
  assert vt.score(t, np.array([vt.digit(5), EOS])) == pytest.approx(0.5)
  assert vt.score(t, np.array([vt.digit(2), 9, EOS])) == pytest.approx(0.75 * 0.7)
  assert vt.score(t, np.array([vt.digit(7), EOS])) == 0.0
  assert vt.score(t, np.array([vt.RED, EOS])) == 0.0


def test_where_scores():
  t = _task("where", {"q": 0})  # top-left
  assert vt.score(t, np.array([vt.digit(0), EOS])) == 1.0
  assert vt.score(t, np.array([vt.digit(1), EOS])) == pytest.approx(0.5)  # top-right
  assert vt.score(t, np.array([vt.digit(2), EOS])) == pytest.approx(0.5)  # bottom-left
  assert vt.score(t, np.array([vt.digit(2), 7])) == pytest.approx(0.35)
  assert vt.score(t, np.array([vt.digit(3), EOS])) == 0.0  # opposite
  assert vt.score(t, np.array([vt.digit(4), EOS])) == 0.0  # not a quadrant
  assert vt.score(t, np.array([vt.SEP, EOS])) == 0.0
  t3 = _task("where", {"q": 3})
  assert vt.score(t3, np.array([vt.digit(1), EOS])) == pytest.approx(0.5)
  assert vt.score(t3, np.array([vt.digit(0), EOS])) == 0.0


def test_perfect_answers_score_one():
  for source in vt.SOURCES:
    for t in _tasks(source, 10, seed=4, image_size=16):
      a = t.answer
      tok = {"colour": lambda: a["token"], "count": lambda: vt.digit(a["k"]),
             "where": lambda: vt.digit(a["q"])}[source]()
      assert vt.score(t, np.array([tok, EOS])) == 1.0


_TASKS = {s: _tasks(s, 4, seed=5, image_size=16) for s in vt.SOURCES}


@settings(max_examples=200, deadline=None)
@given(source=st.sampled_from(vt.SOURCES), i=st.integers(0, 3),
       response=st.lists(st.integers(0, vt.VOCAB_SIZE - 1), max_size=10))
def test_random_responses_score_in_unit_interval(source, i, response):
  r = vt.score(_TASKS[source][i], np.array(response, np.int32))
  assert 0.0 <= r <= 1.0


def test_unknown_source_raises():
  with pytest.raises(ValueError, match="bogus") as err:
    vt.make_task(np.random.default_rng(0), "bogus")
  assert "colour" in str(err.value)  # lists the valid sources
  with pytest.raises(ValueError, match="bogus"):
    vt.score(_task("bogus", {}), np.array([EOS]))
