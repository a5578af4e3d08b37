"""What a dict-backed frozen value costs to read: a 12-field frozen dataclass built by dataclasses'
own __init__ against the same class with kvgate/frozen_values.py's direct_init (its fields in an
instance dict of its own instead of CPython 3.11's inline values): building one, reading a field,
`==` and `hash`, thread CPU, the least of 5 passes of 200,000.

`PYTHONPATH=. taskset -c 1 python bench/results/cpu-session38/read_micro.py` (branch tree).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.frozen_values import direct_init

LOOPS, PASSES = 200_000, 5


@dataclass(frozen=True)
class Generated:
    a: int = 1
    b: int = 2
    c: int = 3
    d: int = 4
    e: int = 5
    f: int = 6
    g: int = 7
    h: int = 8
    i: int = 9
    j: int = 10
    k: int = 11
    m: int = 12


@direct_init
@dataclass(frozen=True)
class Direct(Generated):
    pass


def per_call(run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(PASSES):
        started = time.thread_time()
        for _ in range(LOOPS):
            run()
        best = min(best, time.thread_time() - started)
    return best / LOOPS * 1e6


def report(cls: type[Generated]) -> None:
    x, y = cls(), cls()
    print(
        f"{cls.__name__:9} build {per_call(cls):5.3f} us  read {per_call(lambda: x.e) * 1e3:4.0f} ns"
        f"  == {per_call(lambda: x == y):5.3f} us  hash {per_call(lambda: hash(x)):5.3f} us"
    )


for cls in (Generated, Direct):
    report(cls)
