"""A verifiable math reward: the final answer extracted, compared as a number, the
format checked.

    math_reward("... so the total is \\boxed{29}.", "29")   -> 1.0
    math_reward("... the total is 29.", "29")               -> 0.0  (no final answer)
    math_reward("... \\boxed{30}", "29")                     -> FORMAT_ONLY (0.1)

The final answer is the content of the last `\\boxed{...}` (braces may nest), or
else what follows the last `####` (GSM8K's marker) on its line. Numbers compare
exactly as fractions: "1,234", "-3", "0.5", "1/2", "3.50" and "$12" all parse; a
percent sign divides by 100. A response whose final answer is not a number, or
that has none, gets 0; one with a well-formed final answer that is wrong gets
FORMAT_ONLY, so a policy first learns to answer in the expected format.
"""
from __future__ import annotations

import re
from fractions import Fraction

FORMAT_ONLY = 0.1
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)(/[-+]?\d+)?$")


def extract_answer(text: str) -> str | None:
  """The final answer's text, or None when the response states none."""
  start = text.rfind("\\boxed{")
  if start >= 0:
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
      depth += {"{": 1, "}": -1}.get(text[j], 0)
      if depth == 0:
        return text[i:j].strip()
    return None  # an unclosed box: no final answer
  marker = text.rfind("####")
  if marker >= 0:
    rest = text[marker + 4:].strip().splitlines()
    return rest[0].strip() if rest and rest[0].strip() else None
  return None


def parse_number(text: str) -> Fraction | None:
  """An exact value for a number as people write it, or None."""
  s = text.strip().replace(",", "").replace("$", "").replace(" ", "")
  s = s.removeprefix("\\(").removesuffix("\\)").removesuffix(".")
  percent = s.endswith("%") or s.endswith("\\%")
  s = s.removesuffix("\\%").removesuffix("%")
  frac = re.fullmatch(r"\\d?frac\{([-+]?\d+)\}\{([-+]?\d+)\}", s)
  if frac:
    s = f"{frac.group(1)}/{frac.group(2)}"
  if not _NUMBER.match(s):
    return None
  try:
    value = Fraction(s)
  except (ValueError, ZeroDivisionError):
    return None
  return value / 100 if percent else value


def math_reward(response: str, answer: str, format_only: float = FORMAT_ONLY) -> float:
  """1 for the right number as the final answer, `format_only` for a well-formed
  wrong one, 0 otherwise. `answer` must itself parse as a number."""
  want = parse_number(answer)
  if want is None:
    raise ValueError(f"math_reward: answer {answer!r} is not a number")
  got_text = extract_answer(response)
  if got_text is None:
    return 0.0
  got = parse_number(got_text)
  if got is None:
    return 0.0
  return 1.0 if got == want else format_only
