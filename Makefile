# `make test` builds what is missing, then runs the whole suite (real vLLM included).
# kvgate's venv never gets torch; vLLM (CPU build) lives in its own venv.

PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm

.PHONY: test venv vllm-venv demo

test: venv vllm-venv
	$(VENV)/bin/pytest -q

# The README demo: the simulated vLLM dies of CUDA OOM, then survives behind kvgate (no GPU,
# no real vLLM needed, under a minute).
demo: venv
	$(VENV)/bin/python -m app.demo

venv: $(VENV)/.kvgate-installed

# Reinstalled when pyproject.toml changes, so new dependencies arrive.
$(VENV)/.kvgate-installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	touch $@

vllm-venv:
	PYTHON=$(PYTHON) scripts/setup_vllm_venv.sh $(VLLM_VENV)
