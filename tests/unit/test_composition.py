"""The composition root's wiring of the predictor and the gate, which import nothing of each other:
output lengths learned while a request waits reach its demand through the gate's re-estimation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from kvgate.composition import Runtime
from kvgate.settings import Settings


async def test_a_waiting_request_is_admitted_with_the_output_lengths_learned_while_it_waited(
    tiny_model_dir: Path,
) -> None:
    rt = Runtime(Settings(model=str(tiny_model_dir), block_size=16, max_model_len=2048, num_gpu_blocks=100))
    rt.configure_offline()
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 1000}).encode()
    prediction = (await rt.pipeline.evaluate("completions", body)).prediction
    full = prediction.demand.kv_blocks  # nothing learned yet: room for all 1,000 tokens
    limit = rt.budget.kv_limit()
    assert limit is not None
    assert full <= limit < 2 * full
    holder = await rt.gate.acquire(prediction.demand, 0, "a", basis=prediction)
    waiting = asyncio.create_task(rt.gate.acquire(prediction.demand, 0, "a", basis=prediction))
    await asyncio.sleep(0)
    assert not waiting.done()
    assert rt.gate.waiting == 1
    for _ in range(rt.outputs.min_samples):  # answers of 10 tokens finished meanwhile
        rt.outputs.observe(1000, 10)
    rt.gate.changed()  # as any release or budget move does
    ticket = await asyncio.wait_for(waiting, 1)
    assert ticket.reservation.demand.reserved_new_tokens == 10
    assert ticket.reservation.demand.kv_blocks < full
    assert holder.reservation.demand.kv_blocks == full
    ticket.release()
    holder.release()
    await rt.stop()
