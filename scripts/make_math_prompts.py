"""Generates the arithmetic word-problem prompt set that ships with the repo.

  python scripts/make_math_prompts.py                      # knittrans_jax/data/arith_word_problems.jsonl
  python scripts/make_math_prompts.py --per_source 1000 --seed 3 --out /tmp/arith.jsonl

Three sources, each with an exact integer answer: `add` (one addition), `mul` (one
multiplication) and `two_step` (a product, then a subtraction). Every record is
{"id", "source", "prompt", "answer"} (knittrans_jax/data/prompts.py); the prompt asks
for the final answer in \\boxed{}, which the math reward checks
(knittrans_jax/rollout/math_reward.py). Deterministic in --seed, so the shipped file
is what this script writes (tests/test_math_data.py checks that).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "knittrans_jax", "data", "arith_word_problems.jsonl")
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana", "Ivo", "Jun")
ITEMS = ("apples", "marbles", "stickers", "pencils", "cards", "shells", "stamps", "beads")
ASK = " Give the final answer as \\boxed{N}."


def problem(rng: np.random.Generator, source: str) -> tuple[str, int]:
  name, other = rng.choice(NAMES, 2, replace=False)
  item = str(rng.choice(ITEMS))
  if source == "add":
    a, b = (int(x) for x in rng.integers(2, 500, 2))
    return (f"{name} has {a} {item}. {other} gives {name} {b} more {item}. "
            f"How many {item} does {name} have now?", a + b)
  if source == "mul":
    a, b = (int(x) for x in rng.integers(2, 40, 2))
    return (f"A box holds {a} {item}. How many {item} are in {b} boxes?", a * b)
  if source == "two_step":
    packs, per = (int(x) for x in rng.integers(2, 20, 2))
    away = int(rng.integers(1, packs * per))
    return (f"{name} buys {packs} packs of {per} {item} and gives {away} of them to {other}. "
            f"How many {item} does {name} keep?", packs * per - away)
  raise ValueError(f"unknown source {source!r}")


def generate(per_source: int, seed: int) -> list[dict]:
  out = []
  for s_index, source in enumerate(("add", "mul", "two_step")):
    rng = np.random.default_rng([seed, s_index])
    for k in range(per_source):
      text, answer = problem(rng, source)
      out.append({"id": f"arith-{source}-{k:05d}", "source": source, "prompt": text + ASK,
                  "answer": str(answer)})
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=DEFAULT_OUT)
  parser.add_argument("--per_source", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  records = generate(args.per_source, args.seed)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
  main()
