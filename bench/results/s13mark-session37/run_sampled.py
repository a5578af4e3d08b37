"""One arm of one scenario on the full benchmark's seeded traffic (as `python -m bench.repeat_arm`
plays it), sampling the simulator's running and waiting counts every 10 ms of wall time.

Usage, from the tree to measure: `PYTHONPATH=. python run_sampled.py S13 kvgate <work dir>`
(arms: kvgate, oracle, none, cap-N). Prints one JSON line; writes <work dir>/samples.json.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import safety
from bench.scenarios import SCENARIOS

SEED = 1000  # bench.repeat_arm's default base seed


def main() -> None:
    key, arm, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    scn = next(s for s in SCENARIOS if s.key == key)
    safety.quiet()
    calls = scn.traffic(random.Random(SEED + list(SCENARIOS).index(scn)), 1.0)
    out.mkdir(parents=True, exist_ok=True)
    started = safety.simulator
    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()

    @contextlib.contextmanager
    def sampled(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with started(*args, **kwargs) as (sim, counts, ostats):

            def poll() -> None:
                while not stop.is_set():
                    scheduler = sim.engine.scheduler
                    samples.append((time.time(), len(scheduler.running), len(scheduler.waiting)))
                    time.sleep(0.01)

            threading.Thread(target=poll, daemon=True).start()
            try:
                yield sim, counts, ostats
            finally:
                stop.set()

    safety.simulator = sampled
    cap = None
    if arm.startswith("cap-"):
        arm, cap = "cap", int(arm[4:])
    r = safety.run_arm(scn, arm, calls, 1.0, out, cap=cap)
    (out / "samples.json").write_text(json.dumps(samples))
    running = sorted(s[1] for s in samples)
    line = {
        "arm": arm,
        "oom": r.oom_crashes,
        "goodput": r.goodput_tokens_per_s,
        "p50": r.ttft_p50_s,
        "p99": r.ttft_p99_s,
        "running_max": running[-1],
        "running_p50": statistics.median(running),
        "running_p90": running[int(0.9 * len(running))],
        "n": len(running),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
