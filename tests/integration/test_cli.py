"""`kvgate serve` re-executes itself once with glibc's malloc tunable, and only from a command line."""

from __future__ import annotations

import os
import sys

import pytest

from kvgate import cli
from kvgate.cli import MALLOC_TUNABLE, malloc_tuned_env, on_glibc

# On another C library (musl) kvgate never re-executes: test_not_on_other_c_libraries checks that.
glibc_only = pytest.mark.skipif(
    not on_glibc(),
    reason="GLIBC_TUNABLES is read only by glibc; this C library is not glibc, so "
    "kvgate serve does not re-execute (test_not_on_other_c_libraries covers that case)",
)


@glibc_only
def test_the_tunable_is_added_to_what_the_operator_set_and_never_overrides_it() -> None:
    assert malloc_tuned_env({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": MALLOC_TUNABLE}
    tuned = malloc_tuned_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert tuned == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{MALLOC_TUNABLE}"}
    assert malloc_tuned_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}) is None
    assert malloc_tuned_env(tuned) is None  # after the re-execution: no second one


def test_not_on_other_c_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    def unknown(name: str) -> str:
        raise ValueError(name)  # musl has no CS_GNU_LIBC_VERSION

    monkeypatch.setattr(os, "confstr", unknown)
    assert malloc_tuned_env({}) is None


@glibc_only
def test_only_a_serve_command_line_re_executes(monkeypatch: pytest.MonkeyPatch) -> None:
    execs: list[tuple[str, list[str], dict]] = []

    class Replaced(Exception):
        pass

    def execve(path: str, argv: list[str], env: dict) -> None:
        execs.append((path, argv, env))
        raise Replaced

    served: list[object] = []
    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(cli, "serve", lambda args: served.append(args) or 0)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(sys, "argv", ["kvgate", "serve", "--model", "/m"])
    with pytest.raises(Replaced):
        cli.main()
    assert execs == [
        (sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLE})
    ]
    assert cli.main(["serve", "--model", "/m"]) == 0
    assert len(served) == 1
    assert len(execs) == 1
    monkeypatch.setattr(cli.capacity, "run", lambda args: 0)
    monkeypatch.setattr(sys, "argv", ["kvgate", "capacity", "--model-config", "/m", "--kv-cache-memory-bytes", "1"])
    assert cli.main() == 0
    assert len(execs) == 1


def test_log_records_skip_caller_thread_and_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    for name in ("_srcfile", "logThreads", "logProcesses", "logMultiprocessing"):
        monkeypatch.setattr(logging, name, getattr(logging, name))  # restored after the test
    cli.configure_logging("info")
    record = logging.getLogger("kvgate.decision").makeRecord("kvgate.decision", logging.INFO, "f", 1, "m", (), None)
    assert logging._srcfile is None
    assert (record.thread, record.process, record.processName) == (None, None, None)


def test_log_time_is_loggings_own_format_once_a_second() -> None:
    """kvgate's formatter writes asctime exactly as logging.Formatter does, across seconds."""
    import logging

    from kvgate.logs import LOG_FORMAT, SecondCachedFormatter

    ours, theirs = SecondCachedFormatter(LOG_FORMAT), logging.Formatter(LOG_FORMAT)
    for created in (1_795_000_000.0, 1_795_000_000.999, 1_795_000_001.0005, 1_795_000_001.5, 1_795_003_600.25):
        record = logging.LogRecord("kvgate.decision", logging.INFO, "f", 1, "m", (), None)
        record.created, record.msecs = created, int((created - int(created)) * 1000)
        assert ours.format(record) == theirs.format(record)
