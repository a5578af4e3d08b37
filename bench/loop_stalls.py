"""`python -m bench.loop_stalls --out FILE -- python -m kvgate.cli serve ...`: kvgate with its event
loop's stalls recorded, to find what makes the worst /healthz probe slow.

Runs `kvgate.cli` in this process with three recorders, each writing JSON lines to FILE:
- "gc": every garbage collection of 5 ms or more (gc.callbacks): its generation, wall and CPU
  time (the thread's), the thread, and for a full one the objects it walked;
- "slow_callback": every event-loop callback of 20 ms or more, as the loop's debug mode reports
  it (uvloop's, uvicorn's loop here; the threshold lowered from 100 ms; debug mode itself adds
  some cost to every callback);
- "stall": a watchdog thread that sees the loop's 5 ms heartbeat late by 40 ms or more records
  the main thread's stack as it finds it (sys._current_frames). The watchdog needs the GIL too:
  a stall inside one C call that holds it (json.loads of a large body) is seen when it ends, and
  its stack is then where the loop went next; a stall of many Python steps is seen while it runs.

For diagnosis only (bench/healthz_hostile.py --stalls FILE starts kvgate through it): the
recorders cost time themselves, so no latency of such a run is a benchmark.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import threading
import time
import traceback
from typing import Any, TextIO

GC_MIN_S = 0.005
SLOW_CALLBACK_S = 0.02
HEARTBEAT_S = 0.005
STALL_S = 0.04


class _Recorder:
    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()
        self._gc_started = self._gc_cpu = 0.0
        self._gc_objects = 0
        self.heartbeat = time.monotonic()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "t": round(time.time(), 3), **fields})
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            # the objects a full collection walks (the frozen start-up heap excluded): counted
            # before the clock starts
            self._gc_objects = len(gc.get_objects(2)) if info["generation"] == 2 else 0
            self._gc_started, self._gc_cpu = time.perf_counter(), time.thread_time()
            return
        took = time.perf_counter() - self._gc_started
        if took >= GC_MIN_S:
            self.write(
                "gc",
                generation=info["generation"],
                ms=round(took * 1000, 1),
                cpu_ms=round((time.thread_time() - self._gc_cpu) * 1000, 1),
                gen2_objects=self._gc_objects,
                thread=threading.current_thread().name,
                collected=info["collected"],
            )

    def beat(self, loop: asyncio.AbstractEventLoop) -> None:
        self.heartbeat = time.monotonic()
        loop.call_later(HEARTBEAT_S, self.beat, loop)

    def watch(self, main_ident: int) -> None:
        reported = 0.0
        while True:
            time.sleep(HEARTBEAT_S)
            late = time.monotonic() - self.heartbeat - HEARTBEAT_S
            if late >= STALL_S and self.heartbeat != reported:
                reported = self.heartbeat
                frame = sys._current_frames().get(main_ident)
                stack = traceback.format_stack(frame)[-8:] if frame is not None else []
                self.write("stall", late_ms=round(late * 1000, 1), stack=[s.strip() for s in stack])


class _SlowCallbacks(logging.Handler):
    """asyncio's debug mode logs 'Executing <Handle ...> took 0.123 seconds' on its logger."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__(logging.WARNING)
        self._recorder = recorder

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "took" in message:
            self._recorder.write("slow_callback", message=message[:600])


def main() -> int:
    argv = sys.argv[1:]
    if len(argv) < 3 or argv[0] != "--out" or "--" not in argv:
        raise SystemExit(__doc__)
    out_path = argv[1]
    command = argv[argv.index("--") + 1 :]
    kvgate_args = command[command.index("kvgate.cli") + 1 :]  # after `python -m kvgate.cli`
    recorder = _Recorder(open(out_path, "a"))  # noqa: SIM115 - open for the process's lifetime
    gc.callbacks.append(recorder.on_gc)
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addHandler(_SlowCallbacks(recorder))
    asyncio_logger.setLevel(logging.WARNING)
    import uvloop  # uvicorn's loop when it is installed (its loop="auto")

    new_loop = uvloop.new_event_loop

    def instrumented() -> asyncio.AbstractEventLoop:
        loop = new_loop()
        loop.set_debug(True)
        loop.slow_callback_duration = SLOW_CALLBACK_S
        loop.call_soon(recorder.beat, loop)
        return loop

    uvloop.new_event_loop = instrumented
    threading.Thread(target=recorder.watch, args=(threading.main_thread().ident,), daemon=True).start()
    from kvgate.cli import main as kvgate_main

    return kvgate_main(kvgate_args)


if __name__ == "__main__":
    sys.exit(main())
