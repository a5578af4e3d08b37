"""Stopping the child processes the demo, the benchmarks and the tests start."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`; always reaped."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
