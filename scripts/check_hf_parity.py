"""Parity of our decoder with transformers on tiny random checkpoints of each family
(Qwen2.5, Qwen3, Llama 3): the figures docs/models.md quotes.

  python scripts/check_hf_parity.py [--json runs/hf_parity.json]

Needs the test-only packages (requirements-test.txt: torch CPU, transformers); uses
the tests' checkpoint helpers (tests/hf_helpers.py). For each family: the worst
relative logit error max|ours - theirs| / max|theirs| over the valid positions of a
left- and right-padded batch (float32, on an 8-device fsdp x tensor mesh, both
attention paths), whether 16 greedy tokens equal transformers' generate, and the
error after hf.save -> transformers.from_pretrained.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from knittrans_jax import cli  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", default=None)
  cli.add_check_flag(parser)
  args = parser.parse_args()
  if cli.check_only(args):
    return
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers
  from flax import nnx

  from hf_helpers import FAMILIES, make_checkpoint, padded_batch, torch_logits
  from knittrans_jax.models import hf
  from knittrans_jax.rollout.sampler import SamplerConfig, generate
  from knittrans_jax.mesh import MeshConfig, make_mesh

  mc = MeshConfig(axes=(("fsdp", -1), ("tensor", 2)),
                  rules=(("batch", "fsdp"), ("embed", "fsdp"), ("heads", "tensor"),
                         ("mlp", "tensor"), ("vocab", "tensor")))
  mesh = make_mesh(mc)
  tokens, mask = padded_batch()
  m = mask.astype(bool)

  def rel(a, b):
    return float(np.abs(a[m] - b[m]).max() / np.abs(b[m]).max())

  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for fam in sorted(FAMILIES):
      path = os.path.join(tmp, fam)
      theirs = make_checkpoint(fam, path)
      ref = torch_logits(theirs, tokens, mask)
      row = {"family": fam}
      for attention in ("einsum", "xla"):
        model, config = hf.load(path, mesh=mesh, rules=mc.rules, attention=attention)
        row[f"logit_rel_err_{attention}"] = rel(np.asarray(model(jnp.asarray(tokens),
                                                                 jnp.asarray(mask))), ref)
      graphdef, params = nnx.split(model)
      prompts = [np.array([5, 9, 14, 3, 22], np.int32), np.array([7, 41, 8], np.int32)]
      ours = generate(graphdef, params, prompts, jax.random.key(0),
                      SamplerConfig(max_new_tokens=16, greedy=True, stop_tokens=()))
      ids = np.zeros((2, 5), np.int64)
      att = np.zeros((2, 5), np.int64)
      for i, p in enumerate(prompts):
        ids[i, 5 - len(p):], att[i, 5 - len(p):] = p, 1
      with torch.no_grad():
        want = theirs.generate(input_ids=torch.from_numpy(ids),
                               attention_mask=torch.from_numpy(att), max_new_tokens=16,
                               min_new_tokens=16, do_sample=False, pad_token_id=0,
                               eos_token_id=None).numpy()[:, 5:]
      row["greedy_tokens_equal"] = int(sum((o.tokens == w).sum() for o, w in zip(ours, want)))
      row["greedy_tokens"] = int(want.size)
      out = os.path.join(tmp, fam + "_export")
      hf.save(model, config, out)
      back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
      row["export_rel_err"] = rel(torch_logits(back, tokens, mask), ref)
      rows.append(row)
  print(f"\n{'family':<8} {'logits (einsum)':>16} {'logits (xla)':>13} {'greedy equal':>13} "
        f"{'export':>10}")
  for r in rows:
    print(f"{r['family']:<8} {r['logit_rel_err_einsum']:16.2e} {r['logit_rel_err_xla']:13.2e} "
          f"{r['greedy_tokens_equal']:>6}/{r['greedy_tokens']:<6} {r['export_rel_err']:10.2e}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"jax": jax.__version__, "transformers": transformers.__version__,
                 "torch": torch.__version__, "families": rows}, f, indent=2)


if __name__ == "__main__":
  main()
