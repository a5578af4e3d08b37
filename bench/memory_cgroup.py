"""A memory cgroup of its own for kvgate in a benchmark: the manifests' limit, enforced by the kernel.

`--max-process-memory-bytes` only tells kvgate what it may use; a container's limit is the
kernel's, which OOM-kills the process that passes it. Benchmarks that claim kvgate stays inside
the manifests' 2 GiB (bench/healthz_hostile.py, bench/soak.py) can run it under a real one: a
child of the cgroup this process is in, cgroup v2's `memory.max` where the memory controller is
on the unified hierarchy, else cgroup v1's `memory.limit_in_bytes` (with no swap limit set, as
a pod has none). kvgate is started inside it (`command_prefix`), so its preparation workers are
too, and kvgate reads the limit itself (kvgate/work_budget.py container_memory_limit).

What it reports: the cgroup's peak charge (v2 `memory.peak`, v1 `memory.max_usage_in_bytes`;
page cache of files the processes read or write counts there as well as resident memory), the
OOM kills (v2 `memory.events` oom_kill, v1 `memory.oom_control` oom_kill) and the limit. Needs
write access to the cgroup filesystem (root in a container whose cgroups are mounted writable);
`available()` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: int  # 1 or 2

    @property
    def command_prefix(self) -> list[str]:
        """Prepended to a command: the shell joins the cgroup, then becomes the command."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh"]

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def limit(self) -> int:
        return int(self._read("memory.max" if self.version == 2 else "memory.limit_in_bytes").strip())

    def peak(self) -> int:
        return int(self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes").strip())

    def oom_kills(self) -> int:
        text = self._read("memory.events" if self.version == 2 else "memory.oom_control")
        fields = dict(line.split() for line in text.splitlines() if line.strip())
        return int(fields.get("oom_kill", 0))


def _own_path(version: int) -> Path:
    """The folder of the cgroup this process is in, on the hierarchy that has the memory controller."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if version == 2 and controllers == "":
            return ROOT / path.strip("/")
        if version == 1 and "memory" in controllers.split(","):
            return ROOT / "memory" / path.strip("/")
    raise OSError("no memory cgroup in /proc/self/cgroup")


def _version() -> int:
    controllers = ROOT / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return 2
    if (ROOT / "memory").is_dir():
        return 1
    raise OSError("no memory controller: neither cgroup v2's nor v1's is mounted under /sys/fs/cgroup")


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int, name: str = "kvgate-bench") -> Iterator[MemoryCgroup]:
    """A child memory cgroup limited to `limit_bytes`, removed on exit (once its processes are gone)."""
    version = _version()
    parent = _own_path(version)
    if version == 2:
        with contextlib.suppress(OSError):  # a v2 child needs the controller enabled in its parent
            (parent / "cgroup.subtree_control").write_text("+memory")
    path = parent / f"{name}-{os.getpid()}"
    path.mkdir()
    group = MemoryCgroup(path, version)
    try:
        if version == 2:
            (path / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield group
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # the last processes are still leaving


def available() -> str | None:
    """None when a memory cgroup can be made here, else why not."""
    try:
        with memory_cgroup(64 * 2**20, "kvgate-probe"):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
