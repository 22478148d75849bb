"""The held-out split: evaluation prompts never occur in training, by construction."""
import numpy as np
import pytest

from knittrans_jax.data import split
from knittrans_jax.data.prompts import Prompt, PromptDataError, PromptSet
from knittrans_jax.rollout import tasks, vision_tasks
from knittrans_jax.models import ViTConfig
from knittrans_jax.models.vision_spec import VisionSpec
from knittrans_jax.suites import TextSuite, VisionSuite

EVAL = split.HELD_OUT_GROUP_IDS


def key(task):
  image = getattr(task, "image", None)
  return (task.source, task.prompt.tobytes(), b"" if image is None else image.tobytes())


@pytest.mark.parametrize("source", tasks.SOURCES)
def test_text_split_is_disjoint_and_both_sides_are_drawn(source):
  text = TextSuite()
  train = {key(text.task(0, g, source)) for g in range(3000)}
  held = {key(text.task(1_000_003, EVAL + g, source)) for g in range(300)}
  assert train and held and not train & held
  # Every training draw is on the training side, every evaluation draw held out.
  assert not any(split.held_out(source, np.frombuffer(p, np.int32)) for _, p, _ in train)
  assert all(split.held_out(source, np.frombuffer(p, np.int32)) for _, p, _ in held)
  # The held-out prompts are the generator's own, not a different distribution.
  rng = np.random.default_rng(0)
  space = {key(tasks.make_task(rng, source)) for _ in range(20000)}
  assert held <= space


def test_vision_split_is_disjoint():
  vision = VisionSuite(VisionSpec.tiny(ViTConfig(image_size=16, patch_size=4)))
  for source in vision_tasks.SOURCES:
    train = {key(vision.task(0, g, source)) for g in range(200)}
    held = {key(vision.task(7, EVAL + g, source)) for g in range(50)}
    assert not train & held
    assert all(split.held_out(source, np.frombuffer(p, np.int32), np.frombuffer(i, np.uint8))
               for _, p, i in held)


def test_prompt_file_split_and_a_side_left_empty():
  prompts = [Prompt(f"p{k}", "add", f"what is {k} + 1?", str(k + 1)) for k in range(40)]
  ps = PromptSet(prompts, seed=3)
  train = {ps.prompt_for(g, "add").id for g in range(500)}
  held = {ps.prompt_for(EVAL + g, "add").id for g in range(200)}
  assert train and held and not train & held and len(train | held) > 30
  # A source whose prompts all fall on one side cannot serve the other: a clear error.
  one = next(p for p in prompts if not split.held_out("add", p.prompt))
  with pytest.raises(PromptDataError, match="held-out side"):
    PromptSet([one]).prompt_for(EVAL, "add")
