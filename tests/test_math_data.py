"""Prompt data sets from files and the verifiable math reward (issue 14, part 5)."""
import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest

from knittrans_jax.data import PromptDataError, PromptSet, load_prompts
from knittrans_jax.rollout.math_reward import FORMAT_ONLY, extract_answer, math_reward, parse_number

SHIPPED = os.path.join("knittrans_jax", "data", "arith_word_problems.jsonl")


def test_the_shipped_set_is_what_the_script_writes(tmp_path):
  out = tmp_path / "arith.jsonl"
  proc = subprocess.run([sys.executable, "scripts/make_math_prompts.py", "--out", str(out)],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert out.read_bytes() == open(SHIPPED, "rb").read()
  prompts = load_prompts(SHIPPED)
  assert len(prompts) == 600 and {p.source for p in prompts} == {"add", "mul", "two_step"}
  for p in prompts:  # every answer is the exact integer the prompt implies
    nums = [int(w.strip(".")) for w in p.prompt.split() if w.strip(".").isdigit()]
    want = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b,
            "two_step": lambda a, b, c: a * b - c}[p.source](*nums)
    assert int(p.answer) == want and want >= 0, p


def test_prompt_for_is_a_pure_function_of_seed_group_and_source():
  ps = PromptSet.from_file(SHIPPED, seed=5, sources=("add", "mul"))
  again = PromptSet.from_file(SHIPPED, seed=5)
  picks = [ps.prompt_for(g, "mul") for g in range(50)]
  assert picks == [again.prompt_for(g, "mul") for g in reversed(range(50))][::-1]
  assert all(p.source == "mul" for p in picks) and len({p.id for p in picks}) > 30
  other = PromptSet.from_file(SHIPPED, seed=6)
  assert picks != [other.prompt_for(g, "mul") for g in range(50)]  # the seed matters
  with pytest.raises(PromptDataError, match=r"unknown source 'geometry'"):
    ps.prompt_for(0, "geometry")
  with pytest.raises(PromptDataError, match=r"sources \['geometry'\] have no prompts"):
    PromptSet.from_file(SHIPPED, sources=("add", "geometry"))


@pytest.mark.parametrize("line,match", [
    ('{"id": "a", "source": "s", "prompt": "p"}', r"line 2: field 'answer' is missing"),
    ('{"id": "a", "source": "s", "prompt": "", "answer": "1"}', r"line 2: field 'prompt' = ''"),
    ('{"id": "a", "source": 3, "prompt": "p", "answer": "1"}', r"line 2: field 'source' = 3"),
    ('{"id": "x", "source": "s", "prompt": "p", "answer": "1"}', r"line 2: id 'x' already used on line 1"),
    ('{"id": "a", "source": ', r"line 2 is not JSON"),
    ('[1, 2]', r"line 2: a record is a JSON object, got list"),
])
def test_bad_records_are_named_by_line_and_field(tmp_path, line, match):
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps({"id": "x", "source": "s", "prompt": "p", "answer": "1"}) + "\n"
                  + line + "\n")
  with pytest.raises(PromptDataError, match=match):
    load_prompts(str(path))
  with pytest.raises(PromptDataError, match="does not exist"):
    load_prompts(str(tmp_path / "missing.jsonl"))


def test_the_final_answer_is_extracted():
  assert extract_answer(r"x = 3 so \boxed{4} ... no wait \boxed{5}.") == "5"  # the last box
  assert extract_answer(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"  # nested braces
  assert extract_answer("work\n#### 1,234\nthanks") == "1,234"
  assert extract_answer(r"the answer is 7") is None
  assert extract_answer(r"\boxed{7") is None  # unclosed
  assert extract_answer("####   ") is None


@pytest.mark.parametrize("text,value", [
    ("29", 29), ("1,234", 1234), ("-3", -3), ("0.5", Fraction(1, 2)), ("3.50", Fraction(7, 2)),
    ("1/2", Fraction(1, 2)), ("$12", 12), ("50%", Fraction(1, 2)), (r"\frac{3}{4}", Fraction(3, 4)),
    ("12.", 12), ("x", None), ("1/0", None), ("2 apples", None), ("", None)])
def test_numbers_parse_exactly(text, value):
  assert parse_number(text) == value


def test_math_reward():
  assert math_reward(r"12 + 17 = 29, so \boxed{29}", "29") == 1.0
  assert math_reward(r"\boxed{29.0}", "29") == 1.0  # numeric equality, not string
  assert math_reward("#### 29", "29") == 1.0
  assert math_reward(r"\boxed{30}", "29") == FORMAT_ONLY  # well formed, wrong
  assert math_reward(r"\boxed{twenty-nine}", "29") == 0.0
  assert math_reward("the total is 29", "29") == 0.0  # no final answer: format fails
  with pytest.raises(ValueError, match="answer 'many' is not a number"):
    math_reward(r"\boxed{3}", "many")


def test_math_suite_scores_decoded_responses(tmp_path):
  from hf_helpers import make_tokenizer
  from knittrans_jax.rollout.math_tasks import SHIPPED, MathTaskConfig, MathTasks
  prompts = load_prompts(SHIPPED)
  make_tokenizer(str(tmp_path), [p.prompt for p in prompts])
  suite = MathTasks(MathTaskConfig(prompt_len=200), str(tmp_path), seed=3)
  task = suite.task(7, "mul")
  again = MathTasks(MathTaskConfig(prompt_len=200), str(tmp_path), seed=3).task(7, "mul")
  assert task.answer == again.answer and (task.prompt == again.prompt).all()
  tok = suite.tokenizer
  right = tok.encode(f"so \\boxed{{{task.answer['answer']}}}") + [tok.stop_ids[0]]
  wrong = tok.encode("so \\boxed{-1}")
  after_stop = [tok.stop_ids[0]] + tok.encode(f"\\boxed{{{task.answer['answer']}}}")
  assert suite.score(task, right) == 1.0
  assert suite.score(task, wrong) == pytest.approx(0.1)
  assert suite.score(task, after_stop) == 0.0  # text after the stop token is not the answer
  with pytest.raises(ValueError, match=r"prompt 'arith-.*' is \d+ tokens with the chat "
                                       r"template; MathTaskConfig.prompt_len = 8"):
    MathTasks(MathTaskConfig(prompt_len=8), str(tmp_path)).check_lengths()
