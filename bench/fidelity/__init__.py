"""Fidelity harness: kvgate's V1 memory terms against what vLLM's own code allocates (docs/memory-model.md)."""
