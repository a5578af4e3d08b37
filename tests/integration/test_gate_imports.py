"""What importing the gate loads, seen from a fresh interpreter (in this one, other tests have
imported everything already)."""

from __future__ import annotations


def test_importing_the_gate_loads_no_http_metrics_or_template_library() -> None:
    """The gate is the mechanism: FastAPI, Starlette, Prometheus and jinja2 belong to other layers."""
    import subprocess
    import sys

    probe = "import sys, kvgate.gate.gate; print(sorted(m for m in ('fastapi', 'starlette', 'prometheus_client', 'jinja2') if m in sys.modules))"
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )
