# ravnest_p2p developer entry points. Every target creates .venv on first use:
# torch==2.13.0 first (a CPU build; an unpinned torch would pull a multi-GB CUDA build), then the project.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-unit test-integration test-e2e test-slow test-notebooks test-security docker-test lint format bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

test: lint
	$(PY) -m pytest -q

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

test-e2e: $(STAMP)
	$(PY) -m pytest -q tests/e2e

test-slow: $(STAMP)
	RAVNEST_WRITE_RESULTS=1 $(PY) -m pytest -q -m slow

# notebooks 2 and 3 (checkpoint and recovery; the three training modes), minutes each: also in test-slow.
# Their plots are written next to them (notebooks/*.png).
test-notebooks: $(STAMP)
	RAVNEST_WRITE_RESULTS=1 $(PY) -m pytest -q -m slow tests/e2e/test_notebooks_slow.py

# the whole hostile-input suite (fast and slow), its tally written to benchmarks/results/security.*
test-security: $(STAMP)
	RAVNEST_WRITE_RESULTS=1 $(PY) -m pytest -q -m 'slow or not slow' tests/security

# the volunteer image and a 3-container compose swarm training digits (root + Docker; docs/docker.md).
# Uses a running Docker daemon, or starts dockerd itself (bridge and pools in 198.18.0.0/15) and stops it.
docker-test: $(STAMP)
	RAVNEST_WRITE_RESULTS=1 $(PY) -m pytest -q -m docker tests/docker

bench: $(STAMP)
	$(PY) -m benchmarks

demo: $(STAMP)
	$(PY) -m ravnest_p2p.demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
