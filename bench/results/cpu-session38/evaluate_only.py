"""bench.stage_cpu's evaluate stage alone, with more passes: RequestPipeline.evaluate (parse,
render, tokenize, predict) of bench.overhead.DISTINCT_CHATS chats new to the segment cache, the
least of 5 passes on this thread's CPU clock, in the tree on PYTHONPATH.

`PYTHONPATH=. taskset -c 0 python bench/results/cpu-session38/evaluate_only.py`, from each tree.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from bench.overhead import DISTINCT_CHATS, chat_bodies, model_folder
from bench.stage_cpu import least
from kvgate.composition import Runtime
from kvgate.logs import quiet_transformers_advice
from kvgate.settings import Settings

quiet_transformers_advice()
with tempfile.TemporaryDirectory(prefix="kvgate-evaluate-") as tmp:
    bodies = chat_bodies(DISTINCT_CHATS)
    runtime = Runtime(
        Settings(
            model=str(model_folder(Path(tmp) / "model")),
            max_num_batched_tokens=8192,
            max_model_len=32768,
            gpu_memory_bytes=85520809984,
        )
    )
    runtime.configure_offline()

    async def evaluate_all() -> None:
        for raw in bodies:
            await runtime.pipeline.evaluate("chat", raw)

    print(f"evaluate {least(5, lambda: asyncio.run(evaluate_all())) / len(bodies) * 1e6:8.1f} us a chat")
