"""Held-out H4's sampler step, kvgate's charge against the simulator's allocator (session 33).

`PYTHONPATH=.:tests/unit:tests/support:tests python bench/results/h4ttft-session33/probe.py`
from the repository root: builds H4's booted simulated engine (tests/unit/test_v1_moe_region.py
`h4_engine`: Mixtral-8x7B, H200, vLLM 0.31.0, V1, the advised fixed pool) and kvgate's static
limits for the same deployment, then, for decode batches of n=8 logprob rows beside chat rows
(some with a frequency penalty), prints what the engine's allocator needs beyond the segments it
holds cached (the free memory a step takes) and what kvgate charges the same step.
"""

from __future__ import annotations

from test_v1_moe_region import MIXTRAL, h4_engine, limits_of

from kvgate.memory.activation import sampler_cost, v1_penalty_step_excess_bytes
from kvgate.memory.ceiling import StepHoldings, step_charge
from kvgate.sim.gpu import CudaOutOfMemory
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import MiB

CONTEXT = 300  # tokens of context per row: the sampler's memory does not depend on it
PROMPT = 1024  # the batch's longest prompt (kvgate's penalty prompt ids)


def engine_need(logprob_rows: int, chat_rows: int, penalty_rows: int) -> str:
    """Free memory the simulator's step takes beyond its cached segments, or its OOM."""
    engine = h4_engine()
    free = engine.alloc.device.free()
    reqs = [ReqSlice(1, CONTEXT, logprobs=1, random=True) for _ in range(logprob_rows)]
    reqs += [ReqSlice(1, CONTEXT, random=True, penalties=i < penalty_rows) for i in range(chat_rows)]
    try:
        run_tape(engine.alloc, engine.steps.plan(StepShape(tuple(reqs))), engine.carry.held)
    except CudaOutOfMemory as oom:
        return f"OOM ({str(oom)[:60]})"
    return f"{(free - engine.alloc.device.free()) / MiB:.0f} of {free / MiB:.0f} MiB free"


def main() -> None:
    flags = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "512"]
    limits, predictor = limits_of(MIXTRAL, "0.31.0", flags, 36 * 1024 * MiB)
    cost = sampler_cost(MIXTRAL, predictor.engine)
    print(f"profiled rows {cost.profiled_rows}, profile_emptied {limits.profile_emptied_bytes / MiB:.1f} MiB")
    print(
        "rows | n=8 rows | chat rows (penalty) | engine takes | kvgate charges (logprobs+penalty, logprobs only) | penalty replay excess"
    )
    for lp, chat, pen in ((200, 0, 0), (256, 0, 0), (216, 40, 8), (256, 40, 8), (256, 100, 20), (256, 250, 50)):
        rows = lp + chat
        charges = []
        for penalties in (pen > 0, False):
            s = cost.stage(rows, True, penalties, PROMPT if penalties else 0, longest_output=512 if penalties else 0)
            step = StepHoldings(
                0, 0, 0, s.unprofiled, s.profiled, s.rows, s.penalties + s.prompt_ids + s.output_ids, s.penalty_prompt
            )
            charges.append(
                step_charge(
                    step,
                    limits.profile_emptied_bytes,
                    limits.segment_overhead,
                    limits.profiled_forward_bytes,
                    limits.forward_bytes_per_token,
                    limits.profiled_hidden_bytes,
                    limits.sampler_phase_overhead,
                )
            )
        excess = v1_penalty_step_excess_bytes(MIXTRAL, predictor.engine, False, rows, PROMPT) if pen else 0
        print(
            f"{rows} | {lp} | {chat} ({pen}) | {engine_need(lp, chat, pen)} | "
            f"{charges[0] / MiB:.1f}, {charges[1] / MiB:.1f} MiB | {excess / MiB:.0f} MiB"
        )


if __name__ == "__main__":
    main()
