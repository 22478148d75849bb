"""GRPO on a math prompt set from a tiny random Qwen-format checkpoint: two rollout
workers, disaggregated, constraint-preserving admission; then export and reload."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import transformers
from flax import nnx

from hf_helpers import make_checkpoint, make_tokenizer, padded_batch, torch_logits
from knittrans_jax.job.metrics import read_metrics
from knittrans_jax.models import hf

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """Single-digit problems, and a tokenizer where each '\\boxed{d}' is one token, so a
  random policy states a final answer often enough for GRPO to see reward
  differences (the shipped set's multi-digit answers never appear by chance)."""
  root = tmp_path_factory.mktemp("math")
  rng = np.random.default_rng(0)
  rows = []
  for i in range(60):
    a, b = (int(x) for x in rng.integers(0, 5, 2))
    source, text, ans = [("add", f"What is {a} + {b}?", a + b),
                         ("mul", f"What is {a} * {b % 3}?", a * (b % 3)),
                         ("two_step", f"What is {a} + {b} - {min(a, b)}?", max(a, b))][i % 3]
    rows.append({"id": f"p{i}", "source": source, "prompt": text, "answer": str(ans)})
  prompts = str(root / "digits.jsonl")
  with open(prompts, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  path = str(root / "qwen_tiny")
  make_tokenizer(path, [r["prompt"] for r in rows] * 5, vocab_size=200,
                 added=tuple(f"\\boxed{{{d}}}" for d in range(10)))
  vocab = len(transformers.AutoTokenizer.from_pretrained(path))
  make_checkpoint("qwen2", path, seed=5, vocab_size=vocab)
  return path, prompts


def run(*args, timeout=600):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=timeout)
  assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
  return out.stdout


def params(model):
  return {"/".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_grpo_on_math_from_a_checkpoint_then_export(tmp_path, checkpoint):
  ckpt, prompts = checkpoint
  work = str(tmp_path / "run")
  run("scripts/train.py", "--gin_file", "configs/math_grpo_test.gin", "--workdir", work,
      "--gin_bindings", f"JobConfig.checkpoint = '{ckpt}'",
      "--gin_bindings", f"MathTaskConfig.prompts = '{prompts}'",
      "--gin_bindings", "MathTaskConfig.prompt_len = 96",
      "--gin_bindings", "MathTaskConfig.system = ''",
      "--gin_bindings", "JobConfig.seq_len = 112",
      "--gin_bindings", f"OptimizerConfig.learning_rate = {LR}",
      "--gin_bindings", "JobConfig.train_batches = 2")
  summary = json.load(open(os.path.join(work, "summary.json")))
  assert summary["steps"] == 4 and summary["quota_violations"] == 0
  recs = read_metrics(str(work))
  rewards = [r["reward"] for r in recs]
  assert all(0.0 <= r <= 1.0 for r in rewards) and max(rewards) > 0, rewards

  out = str(tmp_path / "export")
  printed = run("scripts/export_hf.py", "--workdir", work, "--out", out)
  assert "as qwen2" in printed
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "generation_config.json"} <= set(os.listdir(out))
  # Trained from the checkpoint: every tensor moved, by at most what 4 Adam steps at
  # LR allow (a random start would be ~0.02 away).
  before, (after, config) = params(hf.load(ckpt)[0]), hf.load(out)
  assert config.family == "qwen2" and config.tie_embeddings
  moved = {k: float(np.abs(v - before[k]).max()) for k, v in params(after).items()}
  assert all(0 < m <= 4 * LR * 1.01 for m in moved.values()), moved
  # transformers loads the export to the same logits as ours.
  theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens, mask = padded_batch(vocab=config.vocab_size)
  ref = torch_logits(theirs, tokens, mask)
  m = mask.astype(bool)
  ours = np.asarray(after(tokens, mask))
  assert np.abs(ours[m] - ref[m]).max() / np.abs(ref[m]).max() <= 1e-4
