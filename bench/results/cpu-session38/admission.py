"""Issue 22 item 5, session 38: the gate's side of one chat, timed alone on this thread's CPU
clock (time.thread_time), the least of PASSES passes, per chat, with 32 chats in flight as in
`bench.request_cpu --concurrency 32`: Budget.shortfall of the next chat against the ledger (its
sampler stage with the chat joining), Ledger.reserve, the oldest in-flight chat's Ledger.release,
and the batch's sampler stage after it (what the next admission's step reads).

Run from the repository root of each tree to compare (main's, the branch's):
`PYTHONPATH=. taskset -c 0 python bench/results/cpu-session38/admission.py`. It uses only what
both trees have: the demands are the benchmark's chats (bench.overhead.chat_bodies) as kvgate's
own pipeline predicts them (the runtime of bench.stage_cpu).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import deque
from pathlib import Path

from bench.overhead import chat_bodies, model_folder
from bench.stage_cpu import least
from kvgate.composition import Runtime
from kvgate.gate.ledger import Reservation
from kvgate.memory.demand import Demand
from kvgate.settings import Settings

PASSES = 9
IN_FLIGHT = 32
CALLS = 20_000


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-admission-") as tmp:
        folder = model_folder(Path(tmp) / "model")
        settings = Settings(
            model=str(folder), max_num_batched_tokens=8192, max_model_len=32768, gpu_memory_bytes=85520809984
        )
        rt = Runtime(settings)
        rt.configure_offline()

        async def demands() -> list[Demand]:
            return [(await rt.pipeline.evaluate("chat", raw)).prediction.demand for raw in chat_bodies(256)]

        chats = asyncio.run(demands())
        budget, ledger = rt.gate.budget, rt.gate.ledger
        in_flight: deque[Reservation] = deque(ledger.reserve(d) for d in chats[:IN_FLIGHT])
        verdicts: set[str | None] = set()

        def admit_and_release() -> None:
            for i in range(CALLS):
                demand = chats[i % len(chats)]
                verdicts.add(budget.shortfall(demand, ledger))
                in_flight.append(ledger.reserve(demand))
                ledger.release(in_flight.popleft())
                ledger.step()

        took = least(PASSES, admit_and_release) / CALLS
        print(f"admission   {took * 1e6:6.2f} us a chat weighed, reserved, released (verdicts: {sorted(map(str, verdicts))})")


if __name__ == "__main__":
    main()
