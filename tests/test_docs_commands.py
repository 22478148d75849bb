"""Every command the README and docs/*.md show in a fenced code block, tested.

`docs_commands()` extracts them: each line (continuations joined) that calls `make`,
`python`, `.venv/bin/python`, `pytest`, `ray` or a `scripts/*.py`. COVER says what
this file does with each, and the test fails when the docs show a command COVER
does not name (or COVER names one the docs no longer show):
  check     the script runs in this process with the flags shown plus --check_args
            (knittrans_jax/cli.py): its argument parsing, its gin parsing with every
            configurable registered, and its configs built and checked, nothing run
  parse     the script has no --check_args yet: its main runs until parse_args
            returns, so the flags shown parse (what then happens is the long run)
  make      `make -n TARGET` expands; for `make run` and `make store-demo` the
            script command of the recipe then runs with --check_args in a subprocess
            (the path a newcomer takes, `python scripts/...` included)
  files     a pytest command: the test files it names exist
  snippet   python -c: the code runs, its paths substituted
  excluded  not run here, with the reason
`subs` replace a placeholder or a path outside this machine (RUN_DIR, <dir>, /models,
`[--flag]`, `...`) before the command runs; `toy` names the test that runs the same
script at toy size, where one does.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time

import gin
import pytest

from knittrans_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md")),
        *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/results/*.md"))]
PROGRAMS = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(make|python3?|\.venv/bin/python|pytest|ray|scripts/\S+\.py)\s")


def docs_commands() -> dict[str, list[str]]:
  """{command: [FILE:LINE, ...]} for every command line of the docs' fenced blocks
  (```python blocks are code, not commands); trailing comments dropped."""
  found: dict[str, list[str]] = {}
  for doc in DOCS:
    lang, start, buf = None, 0, ""
    with open(os.path.join(ROOT, doc)) as f:
      lines = f.read().splitlines()
    for i, line in enumerate(lines, 1):
      if line.strip().startswith("```"):
        lang = line.strip()[3:] if lang is None else None
        continue
      if lang is None or lang == "python":
        continue
      if not buf:
        start = i
      buf = f"{buf} {line.strip()}" if buf else line.strip()
      if buf.endswith("\\"):
        buf = buf[:-1].rstrip()
        continue
      line, buf = buf, ""
      if PROGRAMS.match(line + " "):
        cmd = _without_comment(line)
        found.setdefault(cmd, []).append(f"{doc}:{start}")
  return found


def _without_comment(line: str) -> str:
  """The line up to its shell comment (a # after a space, outside quotes)."""
  words = shlex.split(line, comments=True)
  for m in re.finditer(r"\s#", line):
    if shlex.split(line[:m.start()]) == words:
      return line[:m.start()].rstrip()
  return line.strip()


@dataclasses.dataclass(frozen=True)
class Cover:
  how: str  # check | parse | make | files | snippet | excluded
  subs: tuple = ()  # (text in the command, what runs in its place)
  toy: str = ""  # the test that runs this script at toy size
  why: str = ""  # excluded: the reason; otherwise what the substitution stands for


TINY = "configs/text_grpo_tiny.gin"
RAY2 = ("--gin_bindings \"JobConfig.cluster = 'ray'\" --gin_bindings \"RayConfig.trainers = 2\" "
        "--gin_bindings \"RayConfig.devices_per_trainer = 2\" "
        "--gin_bindings \"RayConfig.trainer_strategy = 'PACK'\"")
PLAN = (".venv/bin/python scripts/plan_layout.py --model configs/models/qwen2_5_7b.gin "
        "--devices 8 --rows {rows} --seq_len {seq} --gin_bindings \"DecoderConfig.dtype = "
        "'bfloat16'\" --gin_bindings \"DecoderConfig.remat = 'full'\" --json runs/{json}")
MATH_CKPT = "a tiny Qwen2 config.json and tokenizer made here stand in for the downloaded model"
VL_CKPT = "a Qwen2-VL checkpoint: the reader's (tests/test_vlm_qwen_job.py makes a tiny one)"

COVER: dict[str, Cover] = {
    # README.md
    "make run": Cover("make"),
    "make test": Cover("make", why="the recipe is the whole suite: expanded, not run"),
    f".venv/bin/python scripts/train.py --gin_file {TINY} --workdir runs/col --gin_bindings "
    "\"JobConfig.mode = 'colocated'\"": Cover("check", toy="tests/test_job.py"),
    f".venv/bin/python scripts/train.py --gin_file {TINY} --workdir runs/tb --gin_bindings "
    "\"JobConfig.policy = 'train_batch'\" --gin_bindings \"JobConfig.workers = 3\"":
        Cover("check", toy="tests/test_job.py"),
    ".venv/bin/python scripts/train.py --workdir runs/tb --resume":
        Cover("check", toy="tests/test_job_recovery.py"),
    ".venv/bin/python scripts/train.py --gin_file configs/vlm_grpo_tiny.gin --workdir "
    "runs/vlm_grpo_tiny": Cover("check", toy="tests/test_vlm_job.py"),
    ".venv/bin/python scripts/train.py --gin_file configs/text_grpo_vllm.gin --workdir "
    "runs/text_grpo_vllm": Cover("check", toy="tests/test_vllm_job.py"),
    ".venv/bin/python scripts/store_demo.py --gin_file configs/store_demo.gin --workdir "
    "runs/demo2 --gin_bindings \"store_demo.producers = 2\"": Cover("check", toy="tests/test_store_demo.py"),
    ".venv/bin/python scripts/simulate.py --gin_file configs/sim/paper_text.gin --out runs/sim":
        Cover("check", toy="tests/test_bench_scripts.py (configs/sim/tiny.gin)"),
    ".venv/bin/python scripts/reproduce_figures.py --quick --out /tmp/figs":
        Cover("parse", toy="tests/test_bench_scripts.py (--only staleness)"),
    # docs/results/2026-12-07-*.md (docs/status.md's figures, moved from the README before)
    "make install-vllm": Cover("make"),
    "make install-ray": Cover("make"),
    ".venv/bin/python scripts/bench_rollout.py --json runs/bench_rollout.json": Cover("check"),
    ".venv/bin/python scripts/bench_in_flight.py --json runs/bench_in_flight.json":
        Cover("check", toy="tests/test_vllm_engine.py (its compare() on the test's engine)"),
    ".venv/bin/python scripts/bench_in_flight.py --gin_bindings \"DecoderConfig.width = 256\" "
    "--gin_bindings \"DecoderConfig.mlp_width = 1024\" --gin_bindings \"DecoderConfig.depth = 4\" "
    "--gin_bindings \"DecoderConfig.heads = 8\" --json runs/bench_in_flight_w256.json":
        Cover("check", toy="tests/test_vllm_engine.py (its compare() on the test's engine)"),
    ".venv/bin/python scripts/bench_store.py --json runs/bench_store.json --payload_checksum":
        Cover("check", toy="tests/test_bench_scripts.py"),
    ".venv/bin/python scripts/bench_admission.py --json runs/bench_admission.json":
        Cover("check", toy="tests/test_bench_scripts.py"),
    ".venv/bin/python scripts/reproduce_figures.py --only staleness --out figures/":
        Cover("parse", toy="tests/test_bench_scripts.py"),
    ".venv/bin/python scripts/simulate.py --gin_file configs/sim/paper_text.gin --out runs/sim "
    "--seeds 0,1,2,3,4": Cover("check"),
    ".venv/bin/python scripts/bench_multimodal.py --json runs/bench_multimodal.json":
        Cover("check", toy="tests/test_bench_scripts.py"),
    f".venv/bin/python scripts/train.py --gin_file {TINY} --workdir runs/ray1 --overwrite {RAY2}":
        Cover("check", toy="tests/test_ray_fleet.py"),
    ".venv/bin/python scripts/fault_report.py --json runs/fault_report.json":
        Cover("check", toy="tests/faults/test_faults.py (the scenarios, fewer trials)"),
    ".venv/bin/python scripts/reproduce_figures.py --out figures/": Cover("parse"),
    # docs/dataplane.md
    ".venv/bin/python scripts/bench_transfer.py --workload vlm --json runs/transfer_vlm.json "
    "[--no-dedup]": Cover("check", subs=(("[--no-dedup]", "--no-dedup"),),
                          toy="tests/test_bench_transfer.py"),
    ".venv/bin/python scripts/bench_transfer.py --workload text --json runs/transfer_text.json":
        Cover("check"),
    # docs/distributed.md
    f"python scripts/train.py --gin_file {TINY} --workdir runs/ray1 --overwrite {RAY2}":
        Cover("check", toy="tests/test_ray_fleet.py"),
    "python -c \"from knittrans_jax.cluster.ray_setup import write_token; "
    "write_token('/mnt/shared/ray_token')\"": Cover(
        "snippet", subs=(("/mnt/shared/ray_token", "{tmp}/ray_token"),),
        why="the token file goes to a temporary directory"),
    "ray start --head --port 6379 --node-ip-address 10.0.0.1 --resources '{\"trainer_host\": 1}' "
    "--system-config '{\"health_check_period_ms\": 1000, \"health_check_timeout_ms\": 1000, "
    "\"health_check_failure_threshold\": 3}'": Cover(
        "excluded", why="starts a Ray head on the reader's host 10.0.0.1; "
        "tests/test_netns_hosts.py starts one per namespaced host"),
    "ray start --address 10.0.0.1:6379 --node-ip-address 10.0.0.2 --resources "
    "'{\"trainer_host\": 1}'": Cover("excluded", why="joins the reader's cluster (as above)"),
    "ray start --address 10.0.0.1:6379 --node-ip-address 10.0.0.3 --resources "
    "'{\"rollout_host\": 1}'": Cover("excluded", why="joins the reader's cluster (as above)"),
    f"python scripts/train.py --gin_file {TINY} --workdir /mnt/shared/run1 --gin_bindings "
    "\"JobConfig.cluster = 'ray'\" --gin_bindings \"RayConfig.address = '10.0.0.1:6379'\" "
    "--gin_bindings \"RayConfig.token_path = '/mnt/shared/ray_token'\" --gin_bindings "
    "\"RayConfig.trainers = 2\" --gin_bindings \"RayConfig.trainer_resources = {'CPU': 1, "
    "'trainer_host': 1}\" --gin_bindings \"RayConfig.rollout_resources = {'CPU': 1, "
    "'rollout_host': 1}\" --gin_bindings \"JobConfig.store_url = 's3://my-bucket/run1/store'\"":
        Cover("check", toy="tests/test_netns_hosts.py",
              why="check mode connects to nothing and writes nothing: no substitution"),
    "python scripts/bench_cluster.py --json runs/bench_cluster.json --train_batches 16 "
    "--repeats 4": Cover("parse"),
    "python scripts/bench_cluster.py --json runs/bench_cluster.json --train_batches 4 "
    "--repeats 2 --no_liveness": Cover("parse"),
    # docs/learning.md
    ".venv/bin/python scripts/bench_throughput.py --gin_file configs/text_grpo_rollout_bound.gin "
    "--config \"train_batch W=2G: JobConfig.policy = 'train_batch'; JobConfig.window = 32\" "
    "--config \"constraint_preserving W=G: JobConfig.policy = 'constraint_preserving'; "
    "JobConfig.window = 16\" ... --repeats 3 --train_batches 50 --json runs/throughput.json":
        Cover("check", subs=((" ... ", " "),), toy="tests/test_bench_scripts.py",
              why="`...`: more --config flags of the same form"),
    ".venv/bin/python scripts/study.py --gin_file configs/study/staleness.gin --out runs/study":
        Cover("check", toy="tests/test_study.py"),
    ".venv/bin/python scripts/study.py --gin_file configs/study/agentic.gin "
    "--out runs/study_agentic":
        Cover("check", toy="tests/test_study.py (this study's grid on configs/agentic_test.gin)"),
    ".venv/bin/python scripts/study.py --gin_file configs/study/corrections.gin "
    "--out runs/study_corrections": Cover("check", toy="tests/test_objectives.py"),
    ".venv/bin/python scripts/study.py --gin_file configs/study/peers.gin "
    "--out runs/study_peers":
        Cover("check", toy="tests/test_study.py (the agentic study's grid; this one's "
              "configurations are peer-rule bindings, checked here)"),
    # docs/models.md
    ".venv/bin/python scripts/check_hf_parity.py --json runs/hf_parity.json":
        Cover("check", toy="tests/test_hf_models.py (the same parity checks)"),
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu .venv/bin/python -m "
    "pytest -q -s tests/test_qwen_vl_model.py tests/test_qwen_vl_encode_once.py "
    "tests/test_qwen_vl.py": Cover("files"),
    PLAN.format(rows=8, seq=1024, json="plan_7b.json"): Cover("check", toy="tests/test_plan_layout.py"),
    PLAN.format(rows=16, seq=2048, json="plan_7b_after.json") + " [--full_logits]":
        Cover("check", subs=(("[--full_logits]", "--full_logits"),)),
    PLAN.format(rows=16, seq=2048, json="plan_7b_scanned.json")
    + " [--gin_bindings \"DecoderConfig.scan_layers = False\"]": Cover(
        "check", subs=(("[--gin_bindings \"DecoderConfig.scan_layers = False\"]",
                        "--gin_bindings \"DecoderConfig.scan_layers = False\""),)),
    "python scripts/train.py --gin_file configs/math_grpo_hf.gin --gin_file configs/mesh/dp.gin "
    "--workdir runs/math_qwen05 --gin_bindings \"CHECKPOINT = '/models/Qwen2.5-0.5B-Instruct'\"":
        Cover("check", subs=(("/models/Qwen2.5-0.5B-Instruct", "{ckpt}"),), why=MATH_CKPT,
              toy="tests/test_math_job.py"),
    "python scripts/export_hf.py --workdir runs/math_qwen05 --out exports/math_qwen05":
        Cover("check", toy="tests/test_math_job.py (exports its run)"),
    "python scripts/train.py --gin_file configs/math_grpo_hf.gin --workdir gs-or-shared/runs/q7b "
    "--gin_bindings \"CHECKPOINT = '/models/Qwen2.5-7B-Instruct'\" --gin_bindings "
    "\"JobConfig.cluster = 'ray'\" --gin_bindings \"RayConfig.address = 'HEAD:6379'\" "
    "--gin_bindings \"RayConfig.trainers = N\"": Cover(
        "check", subs=(("/models/Qwen2.5-7B-Instruct", "{ckpt}"), ("trainers = N", "trainers = 2"),
                       ("'HEAD:6379'", "'10.0.0.1:6379'")), why=MATH_CKPT),
    # docs/multimodal.md
    "scripts/train.py --gin_file configs/vlm_qwen_tiny.gin --workdir runs/vlm_qwen_tiny "
    "--gin_bindings \"JobConfig.checkpoint = '/path/to/qwen2_vl_checkpoint'\"": Cover(
        "excluded", toy="tests/test_vlm_qwen_job.py", why=VL_CKPT),
    ".venv/bin/python scripts/bench_multimodal.py --json figures/multimodal_sweep.json --sweep "
    "--prompts 8 --mini_batches 1": Cover("check"),
    ".venv/bin/python scripts/bench_multimodal.py --json runs/bench_multimodal_qwen.json --model "
    "<qwen2_vl checkpoint dir> --image 56 --prompts 8 --n 8 --micro 16 --seq 32": Cover(
        "check", subs=(("<qwen2_vl checkpoint dir>", "{tmp}/qwen2_vl"),),
        why="check mode reads no checkpoint; " + VL_CKPT),
    ".venv/bin/python scripts/project_vlm_speedup.py --json runs/project_vlm_speedup.json":
        Cover("check", toy="tests/test_vlm_qwen_projection.py (its FLOP counts)"),
    # docs/rollout.md
    ".venv/bin/python scripts/train.py --gin_file configs/text_grpo_vllm.gin --workdir runs/vllm":
        Cover("check", toy="tests/test_vllm_job.py"),
    "VLLM_SERVER_DEV_MODE=1 .venv/bin/python -m vllm.entrypoints.openai.api_server --model CKPT "
    "--host 127.0.0.1 --port 8000 --skip-tokenizer-init --dtype float32 --logprobs-mode "
    "processed_logprobs --worker-extension-cls knittrans_jax.rollout.vllm_weights.WeightLoader "
    "--max-model-len 256": Cover(
        "excluded", toy="tests/test_vllm_server.py",
        why="starts a server that stays up (on the reader's checkpoint CKPT); the test starts "
            "the same flags (knittrans_jax/testing/vllm_server.server_command) on a tiny one"),
    ".venv/bin/python scripts/train.py --gin_file configs/text_grpo_vllm_server.gin --workdir "
    "runs/vllm_server": Cover("check", toy="tests/test_vllm_server.py"),
    # docs/training.md: the objectives' recipes
    **{f".venv/bin/python scripts/train.py --gin_file configs/agentic_tails.gin --gin_file "
       f"configs/recipes/{r}.gin --workdir runs/{r}": Cover("check", toy="tests/test_objectives.py")
       for r in ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp",
                 "decoupled_ppo")},
    # docs/agents.md
    ".venv/bin/python scripts/train.py --gin_file configs/agentic_tails.gin --workdir runs/agentic "
    "--overwrite": Cover("check", toy="tests/test_agentic_job.py"),
    ".venv/bin/python scripts/train.py --gin_file configs/agentic_vllm.gin --workdir "
    "runs/agentic_vllm --overwrite": Cover("check", toy="tests/test_vllm_job.py"),
    ".venv/bin/python scripts/train.py --gin_file configs/text_long_tails.gin --workdir "
    "runs/long_tails --overwrite": Cover("check"),
    ".venv/bin/python scripts/bench_rollout.py --workload agentic --in_flight 4,16,64 --json "
    "runs/bench_rollout_agentic.json": Cover("check", toy="tests/test_bench_scripts.py"),
    ".venv/bin/python scripts/bench_rollout.py --workload long_tails --json "
    "runs/bench_rollout_long.json": Cover("check"),
    # docs/training.md
    ".venv/bin/python scripts/plan_layout.py --model configs/models/qwen2_5_7b.gin --devices 8 "
    "--rows 8 --seq_len 16384 --packed --gin_bindings \"DecoderConfig.dtype = 'bfloat16'\" "
    "--gin_bindings \"DecoderConfig.remat = 'full'\" --gin_bindings \"DecoderConfig.attention = "
    "'blockwise'\" --json runs/plan_7b_packed_blockwise.json":
        Cover("check", toy="tests/test_plan_layout.py"),
    ".venv/bin/python scripts/bench_throughput.py --gin_file configs/text_long_tails.gin --config "
    "\"packed: JobConfig.packing = True\" --config \"padded: JobConfig.packing = False\" "
    "--repeats 2 --train_batches 6 --skip_train_batches 2 --json "
    "runs/throughput_long_tails_packing.json": Cover("check", toy="tests/test_bench_scripts.py"),
    # docs/simulator.md
    ".venv/bin/python scripts/real_staleness.py --gin_file configs/agentic_tails.gin --seeds 0,1,2 "
    "--train_batches 20 --skip_train_batches 3 --json runs/real_staleness_agentic.json":
        Cover("check", toy="tests/test_real_staleness.py (its pure parts; the runs are the job's)"),
    # docs/admission.md
    ".venv/bin/python scripts/real_peers.py --gin_file configs/agentic_tails.gin --seeds 0,1,2 "
    "--train_batches 20 --skip_train_batches 3 --json runs/figures/real_peers_agentic.json":
        Cover("check", toy="tests/test_peer_rules.py (its configurations and report; the runs "
              "are the job's)"),
    ".venv/bin/python scripts/reproduce_figures.py --only peers --out figures/":
        Cover("parse", toy="tests/test_bench_scripts.py (--quick --only peers)"),
    ".venv/bin/python scripts/reproduce_figures.py --quick --only peers --out /tmp/figs":
        Cover("parse", toy="tests/test_bench_scripts.py (--quick --only peers)"),
    # docs/storage.md
    ".venv/bin/python scripts/bench_store.py --json runs/bench_store.json --mib 8 --reps 2 "
    "--image_reps 1 --growth_gb 4": Cover("check"),
    # docs/vs_tunix.md
    ".venv/bin/python scripts/bench_vs_tunix.py --json runs/bench_vs_tunix.json":
        Cover("parse", toy="tests/test_bench_vs_tunix.py (--dry_run, where Tunix's venv is)"),
    ".venv/bin/python scripts/bench_vs_tunix.py --json runs/vs_tunix_dry.json --dry_run":
        Cover("parse", toy="tests/test_bench_vs_tunix.py (--dry_run, where Tunix's venv is)"),
    ".venv/bin/python scripts/train.py --gin_file configs/vs_tunix/text.gin --workdir "
    "runs/vs_tunix_profile --overwrite --profile": Cover("check"),
}
HOWS = ("check", "parse", "make", "files", "snippet", "excluded")


def test_every_docs_command_is_covered():
  found = docs_commands()
  missing = {c: w for c, w in found.items() if c not in COVER}
  assert not missing, ("commands in the docs that COVER does not name (add each, with what "
                       "runs it):\n" + "\n".join(f"  {w}: {c}" for c, w in missing.items()))
  stale = [c for c in COVER if c not in found]
  assert not stale, "COVER names commands no doc shows any more:\n" + "\n".join(stale)
  assert {c.how for c in COVER.values()} <= set(HOWS)
  for c, cover in COVER.items():
    if cover.how == "excluded":
      assert cover.why, f"excluded without a reason: {c}"
  # The table of what was done with each command, for the log (-s) and the report.
  print(json.dumps({c: dataclasses.asdict(v) | {"where": found[c]} for c, v in COVER.items()},
                   indent=1))


@pytest.fixture(scope="module")
def places(tmp_path_factory):
  """What the substitutions point at: a temporary dir, and a tiny Qwen2-shaped
  checkpoint directory (config.json and a tokenizer; no weights: check mode reads
  none) for the commands that name a downloaded model."""
  tmp = tmp_path_factory.mktemp("docs_commands")
  ckpt = tmp / "qwen2_tiny"
  ckpt.mkdir()
  (ckpt / "config.json").write_text(json.dumps({
      "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1024,
      "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
      "hidden_act": "silu"}))
  _tokenizer(str(ckpt))
  return {"tmp": str(tmp), "ckpt": str(ckpt)}


def _tokenizer(path: str) -> None:
  """A byte-level BPE trained on the shipped word problems, in Qwen's chat format:
  their prompts stay within MathTaskConfig.prompt_len, as a Qwen tokenizer's do, so
  the config's length checks run as on the real model."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  from knittrans_jax.rollout.math_tasks import SHIPPED
  with open(SHIPPED) as f:
    corpus = [json.loads(line)["prompt"] for line in f if line.strip()]
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(corpus, trainers.BpeTrainer(
      vocab_size=1000, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(os.path.join(path, "tokenizer.json"))
  template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] "
              "+ '<|im_end|>\\n' }}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "chat_template": template}, f)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [tok.token_to_id("<|im_end|>")]}, f)


def _substituted(cmd: str, cover: Cover, places: dict) -> str:
  for old, new in cover.subs:
    assert old in cmd, f"substitution {old!r} is not in {cmd!r}"
    cmd = cmd.replace(old, new.format(**places))
  return cmd


def test_docs_scripts_parse_and_check_their_configs(places):
  """Every `check` and `parse` command, in one child process (one JAX import; each
  script module loaded once, so its gin configurables register once)."""
  todo = [{"cmd": _substituted(c, cov, places), "how": cov.how}
          for c, cov in COVER.items() if cov.how in ("check", "parse")]
  # And check mode's own test: a bad value fails, naming it (last: they share the child).
  bad = [{"cmd": f"scripts/train.py --gin_file {gin} "
                 + " ".join(f"--gin_bindings \"{b}\"" for b in bindings.split("; ")),
          "how": "check", "expect": names} for bindings, names, gin in BAD_VALUES]
  todo += bad
  proc = subprocess.run([sys.executable, __file__], input=json.dumps(todo), cwd=ROOT,
                        capture_output=True, text=True, timeout=600,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads(proc.stdout.splitlines()[-1])
  print("\n".join(f"{r['s']:6.2f} s  {r['cmd']}" for r in results))  # -s shows each's time
  assert len(results) == len(todo)
  results, refused = results[:-len(bad)], results[-len(bad):]
  failed = {r["cmd"]: r["error"] for r in results if r["error"]}
  assert not failed, "\n\n".join(f"{c}\n{e}" for c, e in failed.items())
  for r, t in zip(refused, bad):
    assert r["error"] is not None and t["expect"] in r["error"], (t, r)


AGENTIC = "configs/agentic_tails.gin"
BAD_VALUES = [  # (bindings, what the error names, gin file)
    ("JobConfig.workers = 0", "JobConfig.workers = 0", TINY),  # the job's own config
    ("RayConfig.trainers = 0", "RayConfig.trainers = 0", TINY),  # a bound config train.py builds later
    ("SamplerConfig.temperature = 0.5", "LossConfig.temperature", TINY),  # a rule across configs
    # The agentic suite: a budget without room for a turn; an injected hang that
    # would not time out; faults where no worker replaces a group; seq_len too short.
    ("AgentConfig.max_tokens = 8", "AgentConfig.max_tokens = 8 cannot hold", AGENTIC),
    ("AgenticTaskConfig.fault_rate = 0.1; AgentConfig.step_timeout_s = 30.0",
     "AgenticTaskConfig.hang_s = 30 must exceed", AGENTIC),
    ("AgenticTaskConfig.fault_rate = 0.1; JobConfig.mode = 'colocated'",
     "JobConfig.mode = 'colocated'", AGENTIC),
    ("JobConfig.seq_len = 64", "AgentConfig.max_tokens = 80, an episode's longest", AGENTIC),
]


def test_make_targets_expand_and_make_run_checks_its_config():
  """`make -n` expands each documented target; then the train.py command of
  `make run`'s recipe runs as a newcomer's shell would, with --check_args."""
  recipes = {}
  for cmd, cover in COVER.items():
    if cover.how == "make":
      target = cmd.split()[1]
      proc = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
      assert proc.returncode == 0, f"make -n {target}: {proc.stderr}"
      recipes[target] = proc.stdout.splitlines()
  run = [line for line in recipes["run"] if "scripts/train.py" in line]
  assert len(run) == 1, recipes["run"]
  workdir = shlex.split(run[0])[shlex.split(run[0]).index("--workdir") + 1]
  before = _listing(os.path.join(ROOT, workdir))
  proc = subprocess.run(["bash", "-c", run[0] + " --check_args"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "check_args:" in proc.stdout
  # --overwrite is in the recipe: check mode must neither delete nor write the work dir.
  assert _listing(os.path.join(ROOT, workdir)) == before


def _listing(path: str):
  if not os.path.isdir(path):
    return None
  return sorted((p, os.stat(os.path.join(path, p)).st_mtime_ns) for p in os.listdir(path))


def test_pytest_commands_name_existing_files():
  for cmd, cover in COVER.items():
    if cover.how == "files":
      named = [t for t in shlex.split(cmd) if t.startswith("tests/")]
      assert named, cmd
      for path in named:
        assert os.path.isfile(os.path.join(ROOT, path)), f"{cmd}: no {path}"


def test_python_snippets_run(places):
  for cmd, cover in COVER.items():
    if cover.how == "snippet":
      argv = shlex.split(_substituted(cmd, cover, places))
      assert argv[:2] == ["python", "-c"], cmd
      exec(compile(argv[2], "<docs snippet>", "exec"), {})
      assert os.path.isfile(os.path.join(places["tmp"], "ray_token"))


def test_configurable_modules_are_every_module_that_registers_one():
  """cli.CONFIGURABLE_MODULES against the package's sources: a new @gin.configurable
  in a module not listed would be unknown to a gin file again."""
  pkg = os.path.join(ROOT, "knittrans_jax")
  registering = set()
  for path in glob.glob(f"{pkg}/**/*.py", recursive=True):
    with open(path) as f:
      if re.search(r"^\s*@gin\.configurable|gin\.external_configurable\(", f.read(), re.M):
        registering.add(os.path.relpath(path, ROOT)[:-3].replace(os.sep, "."))
  assert registering == set(cli.CONFIGURABLE_MODULES)


def test_scripts_parse_gin_through_cli():
  """A script that parsed with gin_cli.parse would again know only what it imported."""
  offenders = []
  for path in sorted(glob.glob(f"{ROOT}/scripts/*.py")):
    with open(path) as f:
      if "gin_cli.parse(" in f.read():
        offenders.append(os.path.relpath(path, ROOT))
  assert set(offenders) <= set(KNOWN_GIN_CLI_PARSE), offenders


# reproduce_figures.py parses only configs/sim/*.gin, whose configurables it imports;
# it moves to cli.parse with its split (issue 42, item 5).
KNOWN_GIN_CLI_PARSE = ["scripts/reproduce_figures.py"]


class _Parsed(Exception):
  pass


def _run_one(cmd: str, how: str, modules: dict) -> str | None:
  """Runs one docs command's script in this process; returns None or what failed."""
  argv = shlex.split(cmd)
  while argv and re.match(r"^[A-Z_]+=", argv[0]):
    argv.pop(0)
  if argv and argv[0] in ("python", "python3", ".venv/bin/python"):
    argv.pop(0)
  script = argv[0]
  if not re.fullmatch(r"scripts/\w+\.py", script):
    return f"not a scripts/*.py command: {argv}"
  if script not in modules:
    spec = importlib.util.spec_from_file_location(f"docs_{os.path.basename(script)[:-3]}",
                                                  os.path.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    modules[script] = module
  out = io.StringIO()
  original = argparse.ArgumentParser.parse_args

  def stop_after_parsing(self, *a, **k):
    original(self, *a, **k)
    raise _Parsed

  sys.argv = [script, *argv[1:]] + (["--check_args"] if how == "check" else [])
  if how == "parse":
    argparse.ArgumentParser.parse_args = stop_after_parsing
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      modules[script].main()
  except _Parsed:
    return None
  except SystemExit as e:  # parser.error, or a script's own refusal
    return f"exit {e.code}: {out.getvalue()[-2000:]}"
  except Exception as e:  # noqa: BLE001  (reported with the command)
    return f"{type(e).__name__}: {e}\n{out.getvalue()[-2000:]}"
  finally:
    argparse.ArgumentParser.parse_args = original
    gin.clear_config()
  if how == "parse":
    return "main() returned without parsing its arguments"
  if "check_args:" not in out.getvalue():
    return f"no check_args line: {out.getvalue()[-2000:]}"
  return None


if __name__ == "__main__":  # the child of test_docs_scripts_parse_and_check_their_configs
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  modules: dict = {}
  results = []
  for t in json.load(sys.stdin):
    t0 = time.perf_counter()
    error = _run_one(t["cmd"], t["how"], modules)
    results.append({"cmd": t["cmd"], "error": error, "s": round(time.perf_counter() - t0, 2)})
  sys.stdout.write("\n" + json.dumps(results) + "\n")

