"""Session 31, s9level: the numbers in README.md. Run from the repository root with
level.patch applied (`git apply bench/results/s9level-session31/level.patch`):

    PYTHONPATH=. .venv/bin/python bench/results/s9level-session31/driver.py

1. kvgate's replay of S9's steps after one-step histories against the simulator's, every count;
2. the level of rows (sampler_level_rows) at every 8 prefill tokens of one 64-token band;
3. at the states where main refuses the next chat: the limit, the level's capacity, and the
   level there and at the raw headroom;
4. chats admitted beside one open prefill, main's charge and with the level (exact prefill keys).
"""

# ruff: noqa: E402
import json
import sys
import time

sys.path[:0] = ["tests", "tests/unit"]

import test_speculative_v2_steps as T
from sim_support import make_engine

from bench.scenarios import SCENARIOS
from kvgate.engine_config import static_limits
from kvgate.gate.budget import Budget
from kvgate.gate.ledger import Ledger
from kvgate.memory import sampler_level as SL
from kvgate.memory.activation import level_capacity
from kvgate.memory.allocator import fits_after_any
from kvgate.openai import parse_request
from kvgate.sim.step_memory import ReqSlice, StepShape
from kvgate.units import GiB

dep = T.deployment._get_wrapped_function()()
pred = T.predictor._get_wrapped_function()(dep)
g, e = pred.layout.geometry, pred.engine
S9 = make_engine(next(s for s in SCENARIOS if s.key == "S9").sim)
RAW = S9.device.free()  # 318,934,877 B
lim = static_limits(dep, pred, None, 80 * GiB, kv_cache_memory_bytes=67131543389)
DEC = T.decoding_slice(T.S9_CHAT)


def budget(level: bool) -> Budget:
    return Budget(
        transient_headroom_bytes=RAW,
        profiled_peak_bytes=lim.profiled_peak_bytes,
        profiled_cap_bytes=lim.profiled_peak_bytes,
        segment_overhead=lim.segment_overhead,
        held_region_bytes=193138688,
        profiled_forward_bytes=lim.profiled_forward_bytes,
        forward_bytes_per_token=lim.forward_bytes_per_token,
        profiled_hidden_bytes=lim.profiled_hidden_bytes,
        sampler_phase_overhead=lim.sampler_phase_overhead,
        lone_forward=lim.lone_forward,
        sampler_level=SL.SamplerLevel(g, e, False, background=False) if level else None,
    )


def demand(tokens: int, i: int):
    body = {"prompt": "x", "max_tokens": 256, **T.S9_CHAT, "seed": i}
    return pred.predict(parse_request("completions", json.dumps(body).encode()).request, [[11 + i] * tokens]).demand


def agreement(prefill: int) -> None:
    """Section 1: one-step histories every 64 tokens, counts 20-63."""
    sim_row, kv_row = "", ""
    for n in range(20, 64):
        chunk = min(prefill, 2048 - n * 6)
        step = StepShape((*[DEC] * n, *([ReqSlice(chunk, 0, random=True, seeded=True)] if chunk else [])))
        rows = 6 * n + (1 if chunk else 0)
        sim, tapes = True, []
        for t in range(64, 2049, 64):
            other = max(1, t - n * 6)
            earlier = (StepShape((ReqSlice(t, 0, samples=False),)), StepShape((*[DEC] * n, ReqSlice(other, 0))))
            sim = sim and all(T.sim_runs_after_s9_start_up(S9, h, step) for h in earlier)
            tapes += [[SL.profile_forward_tape(g, e, t)], [SL.sampled_step_tape(g, e, other + 6 * n, 6 * n + 1)]]
        kv = fits_after_any(SL.sampled_step_tape(g, e, chunk + 6 * n, rows), tapes, RAW)
        sim_row += "1" if sim else "."
        kv_row += "1" if kv else "."
    print(f"prefill {prefill}: simulator {sim_row}\n{'':13}kvgate    {kv_row}  (counts 20-63)", flush=True)


def exact(self: SL.SamplerLevel, prefill: int, rows: int, capacity: int, sampler_bytes: int) -> bool:
    """SamplerLevel.__call__ keyed by the exact prefill instead of its grid points."""
    capacity -= max(0, sampler_bytes - SL.fp32_copy_bytes(g, e, rows))
    if rows <= 0 or prefill + rows > e.max_num_batched_tokens or capacity <= 0:
        return False
    level = self._lookup((level_capacity(capacity), prefill))
    return level is not None and rows <= level


for p in (0, 500, 1000, 1500):
    agreement(p)
for p in (448, 464, 480, 488, 496, 500, 504, 512):
    t0 = time.time()
    print(
        "level at 305,691,246 B, prefill",
        p,
        SL.sampler_level_rows(g, e, False, p, 305691246),
        f"{time.time() - t0:.0f} s",
    )
main = budget(False)
for p, n in ((0, 50), (500, 39), (1000, 36)):
    ledger = Ledger()
    if p:
        ledger.reserve(demand(p, 999))
    for i in range(n):
        ledger.end_prefill(ledger.reserve(demand(600, i)))
    d = demand(600, n)
    st = ledger.step_with(d)
    charge = main._step_charge(st, True, False)
    limit = main.transient_limit(min(main.held_region_bytes, st.profiled_charge(charge)))
    cap = limit - st.unprofiled - max(0, st.sampler_unprofiled - SL.fp32_copy_bytes(g, e, st.sampled_rows))
    prefill = -(-st.forward_profiled // lim.forward_bytes_per_token)
    level = SL.sampler_level_rows(g, e, False, prefill, level_capacity(cap))
    raw = SL.sampler_level_rows(g, e, False, prefill, RAW)
    print(f"open {p}, chat {n + 1}: step prefill {prefill}, rows {st.sampled_rows}, charge {charge}, limit {limit},")
    print(f"  level capacity {cap} (grid {level_capacity(cap)}): level {level} rows; at the raw headroom {raw} rows")
SL.SamplerLevel.__call__ = exact
with_level = budget(True)
for p in (0, 500, 1000, 1400):
    print(p, "main", T.chats_admitted(pred, main, p), "level", T.chats_admitted(pred, with_level, p), flush=True)
