"""Saving a Qwen2-VL / Qwen2.5-VL model (qwen_vl.save): transformers loads the directory
with no missing or unexpected tensors and every tensor equal to the checkpoint we
loaded; our loader reads it back to the same config and parameters."""
import numpy as np
import pytest
import torch
from flax import nnx

from hf_helpers import QWEN_VL, make_qwen_vl_checkpoint
from knittrans_jax.models import qwen_vl


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_save_then_transformers_and_our_load(tmp_path, family):
  src, out = str(tmp_path / "src"), str(tmp_path / "out")
  original = make_qwen_vl_checkpoint(family, src, seed=7)
  model, config = qwen_vl.load(src, "float32")
  qwen_vl.save(model, out, like=src)

  theirs, info = QWEN_VL[family][1].from_pretrained(out, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  want = original.state_dict()
  got = theirs.state_dict()
  assert set(got) == set(want)
  for name, w in want.items():
    torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)
  assert theirs.config.vision_start_token_id == original.config.vision_start_token_id

  back, config_back = qwen_vl.load(out, "float32")
  assert config_back == config
  for (p, a), (q, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                            nnx.to_flat_state(nnx.state(back, nnx.Param)), strict=True):
    assert p == q
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
