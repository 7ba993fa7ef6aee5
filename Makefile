# Two commands: `make train` (tiny DeepSeek-V3 on CPU or one GPU) and `make test` (the whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv train test lint format

venv: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt
	touch $(STAMP)

# Extra settings go in ARGS, e.g. `make train ARGS="steps=200 model_name=deepseek3-small"`.
train: venv
	$(PY) -m MaxText.train $(ARGS)

# Two workers (one per core here); a test file stays on one worker so its shared runs happen once.
PYTEST_ARGS ?= -n 2 --dist loadfile
test: venv
	$(PY) -m pytest tests $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check MaxText tools tests
	$(PY) -m ruff format --check MaxText tools tests

format: venv
	$(PY) -m ruff format MaxText tools tests
	$(PY) -m ruff check --fix MaxText tools tests
