# `make test` builds what is missing, runs the static checks (lint, types, layer contracts), then
# the whole suite (real vLLM included).
# kvgate's venv never gets torch; vLLM (CPU build) lives in its own venv.

PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm

.PHONY: test check venv vllm-venv demo

test: venv vllm-venv check
	$(VENV)/bin/pytest -q

# Seconds, not minutes: ruff (rules in pyproject.toml), mypy (strict on kvgate.memory and kvgate.gate)
# and the import contracts of docs/architecture.md.
check: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# The README demo: the simulated vLLM dies of CUDA OOM, then survives behind kvgate (no GPU,
# no real vLLM needed, about two minutes).
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
