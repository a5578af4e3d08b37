"""`python -m bench.gate_cpu`: the gate's CPU under a burst, in one process, on this thread's clock.

Benchmark S4's spike (1,521 chats in 5 s) keeps hundreds of requests in flight and hundreds in
kvgate's line while the head waits for transient memory, and an engine step ends and starts many
streams at once. This plays that shape on the gate alone (kvgate.gate.gate.Gate, a Budget whose
transient headroom holds `--in-flight` sampled rows at 8 B each): each round releases `--burst`
in-flight requests in one turn of the event loop, lets the gate admit what fits, and keeps the
admitted ones in flight; `time.thread_time` over `--rounds` rounds (other processes on a shared
machine cost it little), the least of `--passes`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from kvgate.gate.budget import Budget
from kvgate.gate.gate import Gate, Ticket
from kvgate.gate.observer import Observers
from kvgate.memory.demand import Demand
from kvgate.memory.sampler import SamplerCost, SamplerUse

# A two-id vocabulary: 8 B of unprofiled headroom a sampled row that asks for logprobs.
COST = SamplerCost(vocab_size=2, dtype_bytes=1, max_num_seqs=100_000, max_num_batched_tokens=100_000)
ROW_BYTES = 8


def chat(rows: int = 1) -> Demand:
    return Demand(
        prompt_tokens=16,
        max_new_tokens=16,
        shared_block_hashes=(),
        private_blocks=1,
        transient_prefill_bytes=0,
        sampler=SamplerUse(COST, rows, 16, logprobs=True),
    )


async def one_pass(in_flight: int, waiting: int, burst: int, rounds: int) -> tuple[float, int]:
    budget = Budget(
        kv_blocks=10 * (in_flight + waiting), transient_headroom_bytes=ROW_BYTES * in_flight, transient_margin=0.0
    )
    gate: Gate = Gate(budget, Observers(), max_queue=waiting + rounds * burst, max_queue_wait_s=3600.0)
    held: list[Ticket] = [await gate.acquire(chat(), 0, "a") for _ in range(in_flight)]
    tasks = [asyncio.create_task(gate.acquire(chat(), 0, f"t{k % 8}")) for k in range(waiting)]
    await asyncio.sleep(0)  # each task queues in its first step
    if len(gate.queue) != waiting:
        raise RuntimeError(f"{len(gate.queue)} of {waiting} queued")
    admitted = 0
    started = time.thread_time()
    for _ in range(rounds):
        for ticket in held[:burst]:  # one engine step's worth of ends, in one turn of the loop
            ticket.release()
        del held[:burst]
        for _ in range(3):
            await asyncio.sleep(0)
        done = [t for t in tasks if t.done()]
        tasks = [t for t in tasks if not t.done()]
        held.extend(t.result() for t in done)
        admitted += len(done)
        tasks.extend(asyncio.create_task(gate.acquire(chat(), 0, "a")) for _ in range(len(done)))  # arrivals
        for _ in range(2):
            await asyncio.sleep(0)
    elapsed = time.thread_time() - started
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return elapsed, admitted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gate_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", type=int, default=300)
    parser.add_argument("--waiting", type=int, default=500)
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args(argv)
    runs = [asyncio.run(one_pass(args.in_flight, args.waiting, args.burst, args.rounds)) for _ in range(args.passes)]
    cpu_s, admitted = min(runs)
    print(
        json.dumps(
            {
                "in_flight": args.in_flight,
                "waiting": args.waiting,
                "burst": args.burst,
                "rounds": args.rounds,
                "admitted": admitted,
                "cpu_ms_per_round": round(1000 * cpu_s / args.rounds, 3),
                "cpu_us_per_release": round(1e6 * cpu_s / (args.rounds * args.burst), 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
