"""Which steps S9's engine runs out of memory on after a step verifying drafts, on the simulator's
own allocator (kvgate/sim/gpu.py), and the any-cache levels kvgate reads for them.

Run from the repository root: `PYTHONPATH=.:tests python bench/results/specrows-session37/histories.py`
(the simulated engine and its steps as tests/unit/test_any_cache_spec.py builds them). Two-step
histories at 304 MiB free (what kvgate reads in the benchmark): a prefill on a 64-token grid beside
36 - 62 decoding requests verifying 5 drafts each, their logits copied to fp32 (S9's chats at
temperature 0.7), then a whole 2,048-token step beside the same requests (copied or not) or a
2,047-token prefill beside one row. Prints each tensor the next step ran out on, with how many
histories and which request counts.
"""

from __future__ import annotations

import copy
from collections import defaultdict

from sim_support import S9_DRAFTS, prefill_beside, runs_out_on, started_s9

from kvgate.memory.activation import EngineShape, any_cache_forward_level
from kvgate.memory.geometry import ModelGeometry
from kvgate.sim.presets import model_config
from kvgate.units import MiB

FREE = 304 * MiB
ENGINE = EngineShape(
    max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256, runner="v2", num_speculative_tokens=S9_DRAFTS
)


def levels() -> None:
    geometry = ModelGeometry.from_config(model_config("llama-3.1-8b"))
    for rows in (256, 261, 262, 336, None):
        level = any_cache_forward_level(geometry, ENGINE, False, FREE, rows)
        print(f"any-cache level at {FREE // MiB} MiB after steps of up to {rows or 'any number of'} rows: {level}")


def two_step_histories() -> None:
    base = started_s9(FREE)
    rows_per_request = 1 + S9_DRAFTS
    failed: dict[tuple[str, str], list[int]] = defaultdict(list)
    tried = 0
    for requests in range(36, 64, 2):
        for prefill in range(0, 2048 - rows_per_request * requests + 1, 64):
            _, alloc, steps = copy.deepcopy(base)
            if runs_out_on(alloc, steps, prefill_beside(prefill, requests, True, S9_DRAFTS)) is not None:
                continue
            whole = 2048 - rows_per_request * requests
            nexts = {
                "whole step, copied": prefill_beside(whole, requests, True, S9_DRAFTS),
                "whole step, not copied": prefill_beside(whole, requests, False, S9_DRAFTS),
                "2,047 tokens beside one row": prefill_beside(2047, 1, False),
            }
            for kind, shape in nexts.items():
                tried += 1
                tensor = runs_out_on(copy.deepcopy(alloc), steps, shape)
                if tensor is not None:
                    failed[(kind, tensor)].append(requests)
    print(f"two-step histories: {tried} tried, {sum(len(r) for r in failed.values())} ran out")
    for (kind, tensor), requests in sorted(failed.items()):
        print(f"  {kind}: {len(requests)} on {tensor}, after {min(requests)} - {max(requests)} requests")


if __name__ == "__main__":
    levels()
    two_step_histories()
