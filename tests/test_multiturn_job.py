"""A multi-turn task in the job end to end: 'lookup' groups call a tool whose output
the engine inserts mid-response (rollout/tasks.py). The store counts each row's loss
tokens (format 4), the job normalises by them and trains on a scanned model."""
import os

import numpy as np
import pytest

from knittrans_jax.rollout import tasks
from knittrans_jax.storage import TrajectoryStore
from test_job import KEEP_ROWS, check_trained, finish, start

pytestmark = pytest.mark.slow


def test_tool_output_is_stored_masked_and_the_job_trains_on_the_rest(tmp_path):
  work = tmp_path / "run"
  finish(start(work, "TrainBatchSpec.source_quota = {'lookup': 4, 'nearest': 2, 'count': 2}",
               "DecoderConfig.scan_layers = True", "SamplerConfig.temperature = 1.0",
               KEEP_ROWS))
  # Every admitted loss token was trained (tokens_skipped 0): the normaliser the
  # controller planned from the rows' loss-token counts is the masks' own sum.
  summary, recs = check_trained(work, 6)
  store = TrajectoryStore.open("file://" + os.path.join(os.path.abspath(work), "store"))
  trained = {i for r in recs for i in r["ids"]}
  metas = [m for m in store.list_committed() if m.source == "lookup" and m.id in trained]
  payload = store.read(metas).result()
  calls = 0
  for m, toks, mask, lp in zip(metas, payload.tokens, payload.loss_mask, payload.logprobs):
    resp, rmask = toks[m.prompt_len:], mask[m.prompt_len:]
    want = np.ones(resp.size, bool)
    at = np.flatnonzero(resp == tasks.CALL)
    if at.size and at[0] + 1 < resp.size:
      j = at[0]
      want[j + 1:j + 3] = False
      assert resp[j + 1] == tasks.RESULT  # the tool's output, inserted after the call
      calls += 1
    np.testing.assert_array_equal(rmask, want, err_msg=m.id)
    assert m.loss_tokens == int(want.sum()) and (lp[m.prompt_len:][~want] == 0).all()
  assert calls >= 2, calls  # a random policy calls the tool now and then
  assert all(np.isfinite(r["loss"]) for r in recs)
