"""The construction of the per-request frozen dataclasses that kvgate/frozen_values.py's
direct_init serves, in the tree on PYTHONPATH: thread CPU per instance, the least of 7 passes of
20,000, every field given by keyword (the calls on the request path give them so)."""

from __future__ import annotations

import dataclasses
import time

from kvgate.memory.ceiling import Ceiling
from kvgate.memory.footprint import Footprint
from kvgate.memory.kv import PrefixKeys
from kvgate.preparation import Prepared
from kvgate.request import ChatInput, ParsedRequest, ValidRequest
from kvgate.sampling_params import SamplingParams
from kvgate.vllm_routes import Translated

CLASSES = [SamplingParams, Footprint, ValidRequest, ChatInput, ParsedRequest, Translated, PrefixKeys, Prepared, Ceiling]
LOOPS, PASSES = 20_000, 7

total = 0.0
for cls in CLASSES:
    kwargs = {f.name: 0 for f in dataclasses.fields(cls)}
    best = float("inf")
    for _ in range(PASSES):
        started = time.thread_time()
        for _ in range(LOOPS):
            cls(**kwargs)
        best = min(best, time.thread_time() - started)
    total += best / LOOPS
    print(f"{cls.__name__:15} {len(kwargs):3} fields {best / LOOPS * 1e6:6.2f} us")
print(f"{'one of each':15} {total * 1e6:6.2f} us")
