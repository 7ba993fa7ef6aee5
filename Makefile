# Two commands: `make train` (tiny DeepSeek-V3 on CPU or one GPU) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

GPU_VENV := .venv-gpu-compile
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed

.PHONY: venv gpu-compile-deps train test lint format

venv: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt
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
	GPU_COMPILE_PYTHON=$(abspath $(GPU_PY)) $(PY) -m pytest tests $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check MaxText tools tests
	$(PY) -m ruff format --check MaxText tools tests

format: venv
	$(PY) -m ruff format MaxText tools tests
	$(PY) -m ruff check --fix MaxText tools tests
