# Two commands: `make train` (tiny DeepSeek-V3 on CPU or one GPU) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

# The device set: CUDA JAX (requirements-cuda.txt) where `nvidia-smi -L` lists a GPU, else CPU JAX.
# DEVICE_SET=cpu or DEVICE_SET=cuda on the command line overrides the probe.
DEVICE_SET ?= $(if $(shell timeout 10 nvidia-smi -L 2>/dev/null | grep '^GPU'),cuda,cpu)
$(if $(filter-out cpu cuda,$(DEVICE_SET)),$(error DEVICE_SET must be cpu or cuda, not '$(DEVICE_SET)'))
RUN_REQUIREMENTS := requirements.txt $(if $(filter cuda,$(DEVICE_SET)),requirements-cuda.txt)
TEST_REQUIREMENTS := requirements-test.txt requirements-test-hf.txt
STAMP := $(VENV)/.installed-$(DEVICE_SET)
TEST_STAMP := $(VENV)/.installed-test

GPU_VENV := .venv-gpu-compile
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed

.PHONY: venv test-deps gpu-compile-deps train test test-fast lint format lock docker-test

# What `make train` needs: the run's requirements and this repository as an editable package (so
# the tools import MaxText from anywhere). A stamp per device set: a GPU that appears later
# reinstalls with CUDA JAX, and the CPU set takes the CUDA plugin out again. Every stamp goes
# (the test requirements' too, which then install again) so that only the current set's remains.
venv: $(STAMP)

$(STAMP): $(RUN_REQUIREMENTS) pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(addprefix -r ,$(RUN_REQUIREMENTS))
	$(if $(filter cpu,$(DEVICE_SET)),$(PY) -m pip uninstall --quiet --yes jax-cuda13-plugin jax-cuda13-pjrt 2>/dev/null)
	$(PY) -m pip install --quiet --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# What `make test` adds: pytest, ruff, uv and the Hugging Face references.
test-deps: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP) $(TEST_REQUIREMENTS)
	$(PY) -m pip install --quiet $(addprefix -r ,$(TEST_REQUIREMENTS))
	touch $(TEST_STAMP)

# Compiling for a GPU target without a GPU (tools/aot_compile.py --target): JAX's CUDA plugin and
# cuDNN in an environment of their own that sees .venv's packages (a .pth file adds .venv's site
# folder, its editable install included), so that .venv, which `make train` uses, stays free of
# CUDA. Run the tool with $(GPU_PY).
gpu-compile-deps: $(GPU_STAMP)

$(GPU_STAMP): $(TEST_STAMP) requirements-gpu-compile.txt Makefile
	$(PYTHON) -m venv $(GPU_VENV)
	$(PY) -c "import sysconfig; print(f'import site; site.addsitedir({sysconfig.get_paths()[\"purelib\"]!r})')" > \
	  "$$($(GPU_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/cpu-venv.pth"
	$(GPU_PY) -m pip install --quiet --no-deps -r requirements-gpu-compile.txt
	touch $(GPU_STAMP)

# Extra settings go in ARGS, e.g. `make train ARGS="steps=200 model_name=deepseek3-small"`.
train: venv
	$(PY) -m MaxText.train $(ARGS)

# Two workers (one per core here); a test file stays on one worker so its shared runs happen once,
# and the files go out slowest first (tests/conftest.py), not by their number of tests.
# The slowest tests are listed at the end, to keep the suite within its time.
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder --durations=25
test: test-deps gpu-compile-deps
	GPU_COMPILE_PYTHON=$(abspath $(GPU_PY)) $(PY) -m pytest tests --ignore=tests/docker $(PYTEST_ARGS)

# The edit-test loop: the unit tests, without the ones marked slow (whole runs, clusters, compiles).
test-fast: test-deps
	$(PY) -m pytest tests --ignore=tests/docker -m "not slow" $(PYTEST_ARGS)

# The images built and run for real (tests/docker/): a Docker engine (started from Debian's package
# when none answers), local base images when the public ones cannot be pulled. Not part of `make test`.
docker-test: test-deps
	$(PY) -m pytest tests/docker -p no:cacheprovider $(DOCKER_TEST_ARGS)

# The images' lock files, with hashes, from the requirement files (uv: one resolution for every
# platform, so the arm64 GB200/GB300 trays and x86-64 hosts install the same versions).
UV_LOCK = $(VENV)/bin/uv pip compile --quiet --native-tls --universal --python-version 3.11 --generate-hashes --no-header
lock: test-deps
	$(UV_LOCK) requirements.txt -o requirements.lock
	$(UV_LOCK) requirements.txt requirements-test.txt -o requirements-test.lock
	$(UV_LOCK) requirements.txt requirements-cuda.txt -o requirements-cuda.lock
	$(UV_LOCK) requirements-gpu.txt docker/requirements-te-build.txt -o requirements-gpu.lock
	$(UV_LOCK) requirements-gpu.txt docker/requirements-te-build.txt --no-emit-package transformer-engine-jax \
	  -o docker/requirements-gpu-pass1.lock

lint: test-deps
	$(PY) -m ruff check MaxText tools tests
	$(PY) -m ruff format --check MaxText tools tests

format: test-deps
	$(PY) -m ruff format MaxText tools tests
	$(PY) -m ruff check --fix MaxText tools tests
