"""Issue 22 item 5, session 37: the two cuts of the gate's admission, each timed alone on this
thread's CPU clock (time.thread_time), the least of PASSES passes, per admission.

Run from the repository root of each tree to compare (main's, the branch's):
`PYTHONPATH=. taskset -c 0 python bench/results/cpu10-session37/cuts.py`. It uses only what both
trees have: the demands are the benchmark's chats (bench.overhead.chat_bodies) as kvgate's own
pipeline predicts them (the runtime of bench.stage_cpu), 32 of them in flight as in
`bench.request_cpu --concurrency 32`.
- record: Ledger.reserve, the traffic record's admission (TrafficRecord.decided) and the oldest
  in-flight request's release: main walks the new request's hashes and works out the ledger's
  worst step again in the record; the branch reads both off the reservation.
- new_blocks: Ledger.new_blocks of the next chat, which Budget.shortfall weighs every admission.
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
from kvgate.gate.observer import Decision
from kvgate.memory.demand import Demand
from kvgate.settings import Settings

PASSES = 9
IN_FLIGHT = 32
CALLS = 20_000


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-cuts-") as tmp:
        folder = model_folder(Path(tmp) / "model")
        settings = Settings(
            model=str(folder), max_num_batched_tokens=8192, max_model_len=32768, gpu_memory_bytes=85520809984
        )
        rt = Runtime(settings)
        rt.configure_offline()

        async def demands() -> list[Demand]:
            return [(await rt.pipeline.evaluate("chat", raw)).prediction.demand for raw in chat_bodies(256)]

        chats = asyncio.run(demands())
        ledger, record = rt.gate.ledger, rt.traffic
        in_flight: deque[Reservation] = deque(ledger.reserve(d) for d in chats[:IN_FLIGHT])

        def admit_and_record() -> None:
            for i in range(CALLS):
                demand = chats[i % len(chats)]
                reservation = ledger.reserve(demand)
                record.decided(Decision("admit", "fits", "id", demand, reservation))
                in_flight.append(reservation)
                ledger.release(in_flight.popleft())

        def new_blocks() -> None:
            for i in range(CALLS):
                ledger.new_blocks(chats[i % len(chats)])

        print(f"prompt blocks a chat: {chats[0].kv_blocks} (shared prefix with the others in flight)")
        print(
            f"record      {least(PASSES, admit_and_record) / CALLS * 1e6:6.2f} us an admission reserved, recorded, released"
        )
        print(f"new_blocks  {least(PASSES, new_blocks) / CALLS * 1e6:6.2f} us a call")


if __name__ == "__main__":
    main()
