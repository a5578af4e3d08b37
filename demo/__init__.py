"""`make demo` and the helpers the demo, the benchmarks and the tests share (starting kvgate
beside a simulated vLLM, stopping child processes).

Outside the `kvgate` package on purpose: none of it runs in production (`pip install` and the
container image carry `kvgate` only).
"""
