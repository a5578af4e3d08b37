"""kvgate's benchmark harness: `python -m bench` (see docs/benchmarks.md)."""
