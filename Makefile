# Two commands: `make train` (tiny DeepSeek-V3 on CPU or one GPU) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

GPU_VENV := .venv-gpu-compile
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed

.PHONY: venv gpu-compile-deps train test lint format lock docker-test

venv: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt requirements-test-hf.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt -r requirements-test-hf.txt
	touch $(STAMP)

# Compiling for a GPU target without a GPU (tools/aot_compile.py --target): JAX's CUDA plugin and
# cuDNN in an environment of their own that sees .venv's packages (a .pth file), so that .venv, which
# `make train` uses, stays free of CUDA. Run the tool with $(GPU_PY).
gpu-compile-deps: $(GPU_STAMP)

$(GPU_STAMP): $(STAMP) requirements-gpu-compile.txt
	$(PYTHON) -m venv $(GPU_VENV)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	  "$$($(GPU_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/cpu-venv.pth"
	$(GPU_PY) -m pip install --quiet --no-deps -r requirements-gpu-compile.txt
	touch $(GPU_STAMP)

# Extra settings go in ARGS, e.g. `make train ARGS="steps=200 model_name=deepseek3-small"`.
train: venv
	$(PY) -m MaxText.train $(ARGS)

# Two workers (one per core here); a test file stays on one worker so its shared runs happen once.
PYTEST_ARGS ?= -n 2 --dist loadfile
test: venv gpu-compile-deps
	GPU_COMPILE_PYTHON=$(abspath $(GPU_PY)) $(PY) -m pytest tests --ignore=tests/docker $(PYTEST_ARGS)

# The images built and run for real (tests/docker/): a Docker engine (started from Debian's package
# when none answers), local base images when the public ones cannot be pulled. Not part of `make test`.
docker-test: venv
	$(PY) -m pytest tests/docker -p no:cacheprovider $(DOCKER_TEST_ARGS)

# The images' lock files, with hashes, from the requirement files (uv: one resolution for every
# platform, so the arm64 GB200/GB300 trays and x86-64 hosts install the same versions).
UV_LOCK = $(VENV)/bin/uv pip compile --quiet --native-tls --universal --python-version 3.11 --generate-hashes --no-header
lock: venv
	$(UV_LOCK) requirements.txt -o requirements.lock
	$(UV_LOCK) requirements.txt requirements-test.txt -o requirements-test.lock
	$(UV_LOCK) requirements-gpu.txt docker/requirements-te-build.txt -o requirements-gpu.lock
	$(UV_LOCK) requirements-gpu.txt docker/requirements-te-build.txt --no-emit-package transformer-engine-jax \
	  -o docker/requirements-gpu-pass1.lock

lint: venv
	$(PY) -m ruff check MaxText tools tests
	$(PY) -m ruff format --check MaxText tools tests

format: venv
	$(PY) -m ruff format MaxText tools tests
	$(PY) -m ruff check --fix MaxText tools tests
