"""The agentic learner's rollout engines (scripts/tunix_agentic.py, Tunix's venv): Tunix's
VanillaRollout with generate as shipped, and one that joins the 1-prompt calls of a short
window into one sampler call. Imported by path from scripts/."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time

from tunix.rl.rollout import base_rollout
from tunix.rl.rollout import vanilla_rollout

BATCH_BUCKETS = (8, 32, 128)  # the batched engine's padded batch sizes
WINDOW_S = 0.002  # its coalescing window


class StockRollout(vanilla_rollout.VanillaRollout):
  """Tunix's VanillaRollout with generate as shipped (vanilla_rollout.py:50-75):
  tunix_side.py replaces VanillaRollout.generate for the text workload (a key per call,
  EOS appended, PAD forbidden); here the seed comes per turn and the sampler keeps EOS."""

  def __init__(self, rollout_actor, tokenizer, mesh, rollout_config):
    c = rollout_actor.config
    super().__init__(rollout_actor, tokenizer, base_rollout.CacheConfig(
        cache_size=rollout_config.kv_cache_size, num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim))

  def generate(self, prompts, rollout_config, **kw):
    cfg = rollout_config
    out = self._sampler(
        input_strings=prompts, max_generation_steps=cfg.max_tokens_to_generate,
        max_prompt_length=cfg.max_prompt_length, echo=False, temperature=cfg.temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed, pad_output=False,
        eos_tokens=cfg.eos_tokens, return_logprobs=cfg.return_logprobs)
    return base_rollout.RolloutOutput(text=out.text, logits=out.logits, tokens=out.tokens,
                                      left_padded_prompt_tokens=out.padded_prompt_tokens,
                                      logprobs=out.logprobs)


def _rows(o, a, b):
  """Rows a:b of a RolloutOutput."""
  return base_rollout.RolloutOutput(
      text=o.text[a:b], logits=None, tokens=o.tokens[a:b],
      left_padded_prompt_tokens=o.left_padded_prompt_tokens[a:b],
      logprobs=None if o.logprobs is None else o.logprobs[a:b])


class BatchingRollout(StockRollout):
  """Coalesces the 1-prompt generate calls that arrive within WINDOW_S (the first caller
  leads: it sleeps the window, then runs the queue, up to BATCH_BUCKETS[-1] calls a
  sampler call, padded to len_buckets x BATCH_BUCKETS). One fresh key a call (patch 1)."""

  def __init__(self, rollout_actor, tokenizer, mesh, rollout_config, *, len_buckets, seed):
    super().__init__(rollout_actor, tokenizer, mesh, rollout_config)
    self.len_buckets, self._seed = len_buckets, seed
    self._q, self._cv, self._leader = collections.deque(), threading.Condition(), False
    self.batches = collections.Counter()

  def run_batch(self, prompts, cfg):
    Lb = next(b for b in self.len_buckets if b >= max(len(p.split()) for p in prompts))
    Bb = next(b for b in BATCH_BUCKETS if b >= len(prompts))
    self.batches[f"{Bb}x{Lb}"] += 1
    self._seed += 1  # only the leader (or the warm-up, before train) gets here
    out = StockRollout.generate(self, prompts + [prompts[0]] * (Bb - len(prompts)),
                                dataclasses.replace(cfg, max_prompt_length=Lb, seed=self._seed))
    return _rows(out, 0, len(prompts))

  def generate(self, prompts, rollout_config, **kw):
    if isinstance(prompts, str):  # the agentic path hands over one str
      prompts = [prompts]
    if len(prompts) != 1:  # the warm-up: one padded batch
      return self.run_batch(prompts, rollout_config)
    slot = {"prompt": prompts[0], "cfg": rollout_config, "out": None}
    with self._cv:
      self._q.append(slot)
      lead, self._leader = not self._leader, True
    if lead:
      time.sleep(WINDOW_S)
    while lead:
      with self._cv:
        if not self._q:
          self._leader = False
          break
        batch = [self._q.popleft() for _ in range(min(len(self._q), BATCH_BUCKETS[-1]))]
      try:
        cfg = batch[0]["cfg"]  # each turn asks for max_new_tokens (patch 2): one program
        if any(s["cfg"].max_tokens_to_generate != cfg.max_tokens_to_generate for s in batch):
          raise RuntimeError("turns of different lengths in one sampler call")
        out = self.run_batch([s["prompt"] for s in batch], cfg)
        res = [_rows(out, j, j + 1) for j in range(len(batch))]
      except BaseException as e:  # noqa: BLE001 (every waiter gets the error)
        res = [e] * len(batch)
      with self._cv:
        for s, o in zip(batch, res):
          s["out"] = o
        self._cv.notify_all()
    with self._cv:
      while slot["out"] is None:
        self._cv.wait()
    if isinstance(slot["out"], BaseException):
      raise slot["out"]
    return slot["out"]
