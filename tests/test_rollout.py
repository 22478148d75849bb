"""The sampler (KV cache) agrees with the training forward pass; tasks score as documented."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from knittrans_jax.models import DecoderConfig, DecoderLM
from knittrans_jax.rl import token_logprobs
from knittrans_jax.rollout import tasks
from knittrans_jax.rollout.groups import rollout_groups
from knittrans_jax.suites import TextSuite, VisionSuite
from knittrans_jax.rollout.sampler import SamplerConfig, generate

CFG = DecoderConfig(vocab_size=64, width=32, depth=2, heads=4, mlp_width=64)
TEXT = TextSuite()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_match_the_training_forward(temperature):
  with nnx.use_eager_sharding(False):
    model = DecoderLM(CFG, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(2, 64, int(rng.integers(3, 9))).astype(np.int32) for _ in range(6)]
  cfg = SamplerConfig(max_new_tokens=12, temperature=temperature, stop_tokens=(1,))
  out = generate(graphdef, params, prompts, jax.random.key(1), cfg)
  seqs = [np.concatenate([p, o.tokens]) for p, o in zip(prompts, out)]
  L = max(map(len, seqs))  # right-padded: causal attention keeps each row's prefix exact
  padded = jnp.asarray(np.stack([np.pad(s, (0, L - len(s))) for s in seqs]))
  valid = jnp.asarray(np.arange(L)[None] < np.array([len(s) for s in seqs])[:, None])
  ref = np.asarray(jax.jit(lambda t, v: token_logprobs(
      nnx.merge(graphdef, params)(t, v) / temperature, t)[0])(padded, valid))
  for i, (p, o) in enumerate(zip(prompts, out)):
    resp, lp = o.tokens, o.logprobs
    assert o.inserted is None  # no tool given
    assert 1 <= resp.size <= 12 and lp.shape == resp.shape
    assert (resp[:-1] != 1).all()  # stops at the first stop token
    np.testing.assert_allclose(lp, ref[i, p.size:p.size + resp.size], atol=2e-5)


def test_top_p_keeps_only_the_nucleus():
  with nnx.use_eager_sharding(False):
    model = DecoderLM(CFG, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  prompts = [np.array([2, 3, 16, 6], np.int32)] * 32
  greedy = generate(graphdef, params, prompts, jax.random.key(0),
                    SamplerConfig(max_new_tokens=1, top_p=1e-6))
  assert len({int(o.tokens[0]) for o in greedy}) == 1  # only the top token survives


def test_top_p_behaviour_logprobs_are_the_nucleus_distribution():
  """With top_p < 1 the recorded log-prob is that of the renormalised nucleus the
  token was drawn from: log p(token) - log(nucleus mass), at every position."""
  with nnx.use_eager_sharding(False):
    model = DecoderLM(CFG, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(2, 64, 5).astype(np.int32) for _ in range(8)]
  top_p = 0.6
  out = generate(graphdef, params, prompts, jax.random.key(3),
                 SamplerConfig(max_new_tokens=6, top_p=top_p, stop_tokens=(1,)))
  folded = 0
  for p, o in zip(prompts, out):
    resp, lp = o.tokens, o.logprobs
    seq = np.concatenate([p, resp])
    logits = np.asarray(model(jnp.asarray(seq[None]), jnp.ones((1, seq.size), bool)))[0]
    for t, tok in enumerate(resp):
      probs = np.asarray(jax.nn.softmax(logits[p.size - 1 + t].astype(np.float64)))
      order = np.sort(probs)[::-1]
      # The nucleus: the smallest prefix whose mass reaches top_p (the sampler's rule).
      keep = order[:int(np.sum(np.cumsum(order) < top_p)) + 1]
      assert probs[tok] >= keep[-1] - 1e-6, "a token outside the nucleus was sampled"
      np.testing.assert_allclose(lp[t], np.log(probs[tok]) - np.log(keep.sum()), atol=2e-4)
      folded += keep.sum() < 0.999
  assert folded > 0  # the truncation mattered somewhere, so the test can tell


def test_task_scores():
  t = tasks.Task("nearest", np.array([2, 3, 21, 6]), {"d": 5})
  assert tasks.score(t, np.array([tasks.digit(5), tasks.EOS])) == 1.0
  assert tasks.score(t, np.array([tasks.digit(5), 9, tasks.EOS])) == pytest.approx(0.7)
  assert tasks.score(t, np.array([tasks.digit(9), tasks.EOS])) == pytest.approx(0.5)
  assert tasks.score(t, np.array([tasks.X])) == 0.0
  c = tasks.Task("count", np.array([]), {"n": 3})
  assert tasks.score(c, np.array([tasks.X] * 3 + [tasks.EOS])) == pytest.approx(1.0)
  assert tasks.score(c, np.array([9, 9, 9, tasks.EOS])) == pytest.approx(0.5)
  ch = tasks.Task("chain", np.array([]), {"a": 14, "L": 3})
  want = [tasks.digit(14), tasks.digit(15), tasks.digit(0), tasks.EOS]
  assert tasks.score(ch, np.array(want)) == pytest.approx(1.0)
  rng = np.random.default_rng(0)
  for source in tasks.SOURCES:
    for _ in range(50):
      task = tasks.make_task(rng, source)
      r = tasks.score(task, rng.integers(0, tasks.VOCAB_SIZE, 12))
      assert 0.0 <= r <= 1.0
  with pytest.raises(ValueError, match="unknown task source"):
    tasks.make_task(rng, "poetry")
  # chain_long is the chain task with longer answers (configs/text_grpo_tails.gin).
  lengths = {s: [tasks.make_task(rng, s).answer["L"] for _ in range(400)]
             for s in ("chain", "chain_long")}
  assert 6 <= min(lengths["chain_long"]) and max(lengths["chain_long"]) <= 15
  assert np.median(lengths["chain_long"]) >= 2 * np.median(lengths["chain"])
  long = tasks.Task("chain_long", np.array([]), {"a": 14, "L": 3})
  assert tasks.score(long, np.array(want)) == pytest.approx(1.0)


def test_random_policy_sees_reward_differences():
  """Partial credit gives a randomly initialised policy a learning signal."""
  rng = np.random.default_rng(1)
  spread = []
  for source in tasks.SOURCES:
    task = tasks.make_task(rng, source)
    rewards = [tasks.score(task, rng.integers(0, tasks.VOCAB_SIZE, 8)) for _ in range(64)]
    spread.append(np.std(rewards))
  assert min(spread) > 0


def test_a_group_samples_the_same_however_groups_share_a_call():
  """Response i of group g draws with key (seed, g, i): a worker's call of 2 groups
  and the colocated reference's call of 6 give each group the same responses, so
  the two execution modes differ in the weights they sample with, not the draws."""
  with nnx.use_eager_sharding(False):
    model = DecoderLM(CFG, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  requests = [(g, tasks.SOURCES[g % 3]) for g in range(10, 16)]
  cfg = SamplerConfig(max_new_tokens=8)
  together = rollout_groups(graphdef, params, 0, 7, requests, 4, cfg, TEXT)
  apart = [grp for k in range(0, 6, 2)
           for grp in rollout_groups(graphdef, params, 0, 7, requests[k:k + 2], 4, cfg, TEXT)]
  for a, b in zip(together, apart):
    for x, y in zip(a.trajectories, b.trajectories):
      assert x.group_id == y.group_id and x.reward == y.reward
      np.testing.assert_array_equal(x.response_tokens, y.response_tokens)
      np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
  # ... and different groups (and seeds) do draw differently.
  other = rollout_groups(graphdef, params, 0, 8, requests, 4, cfg, TEXT)
  flat = lambda gs: [t.response_tokens.tolist() for g in gs for t in g.trajectories]  # noqa: E731
  assert flat(other) != flat(together)
  assert len({tuple(r) for r in flat(together)}) > 12
  with pytest.raises(ValueError, match="one key or one per prompt"):
    generate(graphdef, params, [np.array([2, 3], np.int32)] * 3, jax.random.split(jax.random.key(0), 2), cfg)


def test_the_jax_engine_takes_typed_requests_and_keys_a_response_by_its_seed():
  """The engine builds from its spec (no suite) and sees requests only: the suite gives
  a task's prompt and its tool (the lookup task's as a ToolInsert). Groups the engine
  decodes whole equal the colocated reference's one-step episodes, and a response's
  draws follow its integer seed alone: the same seeds under another group id sample
  the same."""
  import dataclasses

  from knittrans_jax.rollout.engine import EngineSpec, GroupRequest, ToolInsert, response_seeds
  from knittrans_jax.rollout.engines import make_engine
  with nnx.use_eager_sharding(False):
    model = DecoderLM(CFG, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  suite, cfg = TEXT, SamplerConfig(max_new_tokens=8)
  sources = {g: ("lookup", "chain", "count")[g % 3] for g in range(20, 25)}
  held = {g: suite.task(7, g, s) for g, s in sources.items()}
  reqs = [GroupRequest(g, t.source, np.asarray(suite.prompt(t), np.int32), 3,
                       response_seeds(7, g, 3), tool=suite.tool(t)) for g, t in held.items()]
  for r, t in zip(reqs, held.values()):
    if t.source == "lookup":
      assert isinstance(r.tool, ToolInsert) and r.tool.call_token == tasks.CALL
      np.testing.assert_array_equal(r.tool.output, t.tool_output)
    else:
      assert r.tool is None
  spec = EngineSpec("jax", CFG, cfg, seed=7, groups_per_call=2, prompts=suite.prompt_spec)
  engine = make_engine(spec, graphdef, params, 0)
  done = engine.generate(reqs)
  ref = rollout_groups(graphdef, params, 0, 7, list(sources.items()), 3, cfg, suite)
  for g, want in zip(done, ref):
    task = held[g.request.group_id]
    for r, y in zip(g.responses, want.trajectories):
      assert suite.score(task, r.tokens) == y.reward
      np.testing.assert_array_equal(r.tokens, y.response_tokens)
      mask = np.ones(r.tokens.size, bool) if r.inserted is None else ~r.inserted
      np.testing.assert_array_equal(mask, y.loss_mask)
  moved = engine.generate([dataclasses.replace(reqs[1], group_id=99)])[0]
  assert [r.tokens.tolist() for r in moved.responses] == [
      r.tokens.tolist() for r in done[1].responses]
  with pytest.raises(ValueError, match="groups_per_call = None"):
    EngineSpec("jax", CFG, cfg, seed=7)


def test_vlm_sampler_logprobs_match_the_training_forward():
  """A group's image is encoded once in the sampler (image_index); the log-probs
  still match the trainer's VLM forward with the image as prefix."""
  from knittrans_jax.models import ViTConfig
  from knittrans_jax.models.vlm import VLM
  from knittrans_jax.rollout import vision_tasks
  vit = ViTConfig(image_size=16, patch_size=4, width=32, depth=2, heads=4, mlp_width=64, merge=2)
  with nnx.use_eager_sharding(False):
    model = VLM(vit, CFG, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(0)
  tasks_ = [vision_tasks.make_task(rng, s, 16) for s in vision_tasks.SOURCES]
  n = 3
  prompts = [t.prompt for t in tasks_ for _ in range(n)]
  images = np.stack([t.image for t in tasks_])
  index = np.repeat(np.arange(len(tasks_)), n)
  cfg = SamplerConfig(max_new_tokens=6, temperature=1.0, stop_tokens=(1,))
  out = generate(graphdef, params, prompts, jax.random.key(2), cfg, images=images,
                 image_index=index)
  seqs = [np.concatenate([p, o.tokens]) for p, o in zip(prompts, out)]
  L = max(map(len, seqs))  # right-padded: one jitted forward for every row
  padded = jnp.asarray(np.stack([np.pad(s, (0, L - len(s))) for s in seqs]))
  valid = jnp.asarray(np.arange(L)[None] < np.array([len(s) for s in seqs])[:, None])
  ref = np.asarray(jax.jit(lambda im, t, v: token_logprobs(
      nnx.merge(graphdef, params)(im, t, v), t)[0])(jnp.asarray(images[index]), padded, valid))
  for k, (p, o) in enumerate(zip(prompts, out)):
    np.testing.assert_allclose(o.logprobs, ref[k, p.size:p.size + o.tokens.size], atol=2e-5)
  # The image matters: the same prompt with another image gives other log-probs.
  seq = np.concatenate([prompts[0], out[0].tokens])[None]
  other = model(jnp.asarray(images[1:2]), jnp.asarray(seq), jnp.ones_like(seq, bool))
  mine = model(jnp.asarray(images[0:1]), jnp.asarray(seq), jnp.ones_like(seq, bool))
  assert np.abs(np.asarray(other) - np.asarray(mine)).max() > 1e-4


def test_a_vision_group_carries_its_image_hashed_once(monkeypatch):
  """rollout_groups makes each image's id where the image is made; the store takes
  the (id, array) pair as it is and does not hash it again."""
  import xxhash

  from knittrans_jax.models import ViTConfig
  from knittrans_jax.models.vlm import VLM
  from knittrans_jax.rollout import vision_tasks
  from knittrans_jax.models.vision_spec import VisionSpec
  from knittrans_jax.storage import Image, StoreSchema, TrajectoryStore, image_id
  vit = ViTConfig(image_size=16, patch_size=4, width=32, depth=2, heads=4, mlp_width=64, merge=2)
  with nnx.use_eager_sharding(False):
    model = VLM(vit, CFG, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  hashes, xxh3 = [], xxhash.xxh3_128
  monkeypatch.setattr(xxhash, "xxh3_128", lambda *a: hashes.append(a) or xxh3(*a))
  requests = [(g, vision_tasks.SOURCES[g % 3]) for g in range(3)]
  groups = rollout_groups(graphdef, params, 0, 7, requests, 2, SamplerConfig(max_new_tokens=4),
                          VisionSuite(VisionSpec.tiny(vit)))
  assert len(hashes) == 3
  store = TrajectoryStore.create("memory://rollout_vision", StoreSchema(sources=vision_tasks.SOURCES))
  writer = store.writer("w")
  for grp in groups:
    (image,) = grp.images
    assert isinstance(image, Image) and all(t.image_ids == (image.id,) for t in grp.trajectories)
    writer.append(grp.trajectories, images=grp.images)
  assert len(hashes) == 3 and writer.commit.images == 3
  assert image_id(groups[0].images[0].array) == groups[0].images[0].id


def test_a_tool_call_inserts_its_output_into_the_context_unsampled():
  """Multi-turn: after a row samples CALL the tool's tokens follow, unsampled (log-prob
  0, `inserted`), and decoding goes on from a context that holds them: the sampled
  tokens' log-probs after them are the training forward's over the whole sequence.
  Rows whose tool output is -1 have no tool."""
  with nnx.use_eager_sharding(False):
    model = DecoderLM(CFG, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(3)
  B, T = 64, 5.0  # a hot sampler: CALL comes up in some rows
  prompts = [np.array([tasks.BOS, tasks.LOOKUP, tasks.digit(k % 16), tasks.SEP], np.int32)
             for k in range(B)]
  tool = np.stack([np.array([tasks.RESULT, tasks.digit(int(rng.integers(16)))], np.int32)
                   for _ in range(B)])
  tool[B // 2:] = -1  # the second half: no tool
  cfg = SamplerConfig(max_new_tokens=16, temperature=T)
  out = generate(graphdef, params, prompts, jax.random.key(4), cfg, tool_outputs=tool,
                 call_token=tasks.CALL)
  seqs = [np.concatenate([p, o.tokens]) for p, o in zip(prompts, out)]
  L = max(map(len, seqs))
  padded = np.stack([np.pad(s, (0, L - len(s))) for s in seqs])
  valid = np.arange(L)[None] < np.array([len(s) for s in seqs])[:, None]
  ref = np.asarray(token_logprobs(model(jnp.asarray(padded), jnp.asarray(valid)) / T,
                                  jnp.asarray(padded))[0])  # one forward for every row
  called = 0
  for i, (p, o) in enumerate(zip(prompts, out)):
    resp, lp, inserted = o.tokens, o.logprobs, o.inserted
    calls = np.flatnonzero(resp == tasks.CALL)
    want = np.zeros(resp.size, bool)
    if i < B // 2 and calls.size and calls[0] + 1 < resp.size:
      j = calls[0]
      want[j + 1:j + 3] = True
      np.testing.assert_array_equal(resp[j + 1:j + 3], tool[i][:resp.size - j - 1])
      called += resp.size > j + 3  # sampled on after the tool's output
    np.testing.assert_array_equal(inserted, want[:resp.size], err_msg=f"row {i}")
    assert (lp[inserted] == 0).all()
    np.testing.assert_allclose(lp[~inserted], ref[i, p.size:p.size + resp.size][~inserted],
                               atol=2e-5)
  assert called >= 3, called
  with pytest.raises(ValueError, match="call_token"):
    generate(graphdef, params, prompts, jax.random.key(4), cfg, tool_outputs=tool)
  with pytest.raises(ValueError, match=r"tool_outputs: an integer array \[64, K\]"):
    generate(graphdef, params, prompts, jax.random.key(4), cfg, tool_outputs=tool[:3],
             call_token=tasks.CALL)


def test_lookup_scores_as_documented():
  task = tasks.make_task(np.random.default_rng(0), "lookup")
  v = task.answer["v"]
  call = [tasks.CALL, *task.tool_output]
  assert tasks.score(task, np.array(call + [tasks.digit(v), tasks.EOS])) == 1.0
  assert tasks.score(task, np.array(call + [tasks.digit(v)])) == pytest.approx(0.7)
  assert tasks.score(task, np.array([tasks.digit(v), tasks.EOS])) == 0.5  # no tool call
  far = (v + 8) % 16
  assert tasks.score(task, np.array(call + [tasks.digit(far), tasks.EOS])) == pytest.approx(
      max(0.0, 1 - abs(far - v) / 8))
  assert tasks.score(task, np.array([tasks.CALL, tasks.EOS])) == 0.0


def test_a_worker_keeps_the_xla_flags_less_the_device_count():
  from knittrans_jax.rollout.worker import one_device_xla_flags
  assert one_device_xla_flags("--xla_force_host_platform_device_count=8 "
                              "--xla_backend_optimization_level=0 --xla_dump_to=/tmp/d") == (
      "--xla_backend_optimization_level=0 --xla_dump_to=/tmp/d")
  assert one_device_xla_flags("") == ""
