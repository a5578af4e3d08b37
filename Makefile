# `make unit`: the static checks, then tests/unit (no subprocess, no server process, no vLLM venv).
# `make test` (what CI runs): builds what is missing, the static checks, then tests/unit and
# tests/integration (real vLLM included).
# kvgate's venv never gets torch; vLLM (CPU build) lives in its own venv.

PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm

.PHONY: test unit check venv vllm-venv demo

test: venv vllm-venv check
	$(VENV)/bin/pytest -q tests/unit tests/integration

unit: venv check
	$(VENV)/bin/pytest -q tests/unit

# Seconds, not minutes: ruff (rules in pyproject.toml), mypy (strict on the modules pyproject lists)
# and the import contracts of docs/architecture.md.
check: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# The demo (docs/demo.md): the simulated vLLM dies of CUDA OOM, then survives behind kvgate (no GPU,
# no real vLLM needed, one to two minutes).
demo: venv
	$(VENV)/bin/python -m demo

venv: $(VENV)/.kvgate-installed

# Reinstalled when pyproject.toml changes, so new dependencies arrive.
$(VENV)/.kvgate-installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	touch $@

vllm-venv:
	PYTHON=$(PYTHON) scripts/setup_vllm_venv.sh $(VLLM_VENV)
