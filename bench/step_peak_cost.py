"""`python -m bench.step_peak_cost [--config FILE] [--tokens N ...]`: the CPU a V2 prompt-logprobs
request's first charge beside others costs the event loop on a deployment of N batched tokens.

The ledger charges such a request the most its step can peak at over every step size up to its
prompt and the others' tokens (kvgate/memory/activation.py `v2_prompt_logprobs_shared_step_extra`,
`_v2_step_peak_upto`), worked out once per deployment and k class and kept. This times that first
charge with the others filling the rest of a step (the largest the ledger can ask), for the k
classes that need no allocator replay (k 1 and 32; the whole vocabulary's replays are warmed on a
worker thread before the deployment serves: `warm_v2_prompt_logprobs_overhead`). The process's
CPU time, on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvgate.memory.activation import EngineShape, v2_prompt_logprobs_shared_step_extra
from kvgate.memory.geometry import ModelGeometry

PROMPT = 600


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="tests/configs/llama-3-8b.json", help="a model's config.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072, 200000], help="max_num_batched_tokens")
    args = parser.parse_args()
    geometry = ModelGeometry.from_config(json.loads(Path(args.config).read_text()))
    print("| max_num_batched_tokens | k | first charge, CPU s | again, CPU s |")
    print("|---:|---:|---:|---:|")
    for tokens in args.tokens:
        engine = EngineShape(tokens, tokens, 256, runner="v2", max_logprobs=-1)
        for k in (1, 32):
            times = []
            for _ in range(2):
                start = time.process_time()
                v2_prompt_logprobs_shared_step_extra.cache_clear()  # the charge's own memo, not the kept peaks
                v2_prompt_logprobs_shared_step_extra(geometry, engine, PROMPT, k, tokens - PROMPT)
                times.append(time.process_time() - start)
            print(f"| {tokens:,} | {k} | {times[0]:.3f} | {times[1]:.4f} |")


if __name__ == "__main__":
    main()
