"""arm.py with a trace of every step of the simulated engine: (wall start, wall end, simulated
seconds, requests running, requests waiting in the engine), as JSON at TRACE; its first entry
is (the load generator's start, 0, 0, -1, -1).

    PYTHONPATH=. python bench/results/s4q-session32/trace.py S4 kvgate LOG TRACE
"""

import json
import runpy
import sys
import time
from pathlib import Path

from bench import safety
from kvgate.sim import engine

TRACE = []
_step = engine.Engine.step


async def step(self):
    t0, sim0 = time.monotonic(), self.sim_clock
    await _step(self)
    s = self.scheduler
    TRACE.append((t0, time.monotonic(), self.sim_clock - sim0, len(s.running), len(s.waiting)))


engine.Engine.step = step
_replay = safety.replay


async def replay(*args, **kwargs):
    TRACE.insert(0, (time.monotonic(), 0.0, 0.0, -1, -1))
    return await _replay(*args, **kwargs)


safety.replay = replay
out = sys.argv.pop(4)
try:
    runpy.run_path(str(Path(__file__).with_name("arm.py")), run_name="__main__")
finally:
    Path(out).write_text(json.dumps(TRACE))
