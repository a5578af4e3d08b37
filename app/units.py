"""Byte units, defined once for kvgate, its simulator, the benchmarks and the tests.

Shared vocabulary: it imports nothing, so the memory model and the simulator (which must not
import each other) may both use it. Binary units are what PyTorch and vLLM print ("49.94 GiB");
decimal ones are what `vllm serve` flags also accept (`1k`, `2G` in vLLM's `human_readable_int`)
and what GPU names say ("80GB").
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12
