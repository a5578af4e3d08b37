"""Issue 22 item 5, session 31: what each candidate cut of a chat request's CPU could save at most.

Run from the repository root: `PYTHONPATH=.:tests taskset -c 0 python
bench/results/cpu9-session31/candidates.py` (tests/ for support.tiny_model, the chats' words).
Each line is the least of 7 passes on this thread's CPU clock (time.thread_time), per call, of
main's own code (nothing here changes kvgate): the parts the candidates would remove or replace.
The benchmark's chats are bench.overhead.chat_bodies' (one system prompt, a new ~100-token user
message each), rendered and tokenized by the overhead benchmark's model folder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvloop

from bench.overhead import chat_bodies, model_folder
from kvgate.composition import Runtime
from kvgate.logs import configure_logging
from kvgate.memory.demand import Demand
from kvgate.memory.kv import block_hashes
from kvgate.openai import parse_request
from kvgate.preparation import prepare
from kvgate.settings import Settings
from kvgate.tokens import LocalTokenizer

PASSES = 7


def per_call(run: Callable[[], object], calls: int) -> float:
    """Least thread CPU microseconds a call over PASSES passes of `calls` calls."""
    best = float("inf")
    for _ in range(PASSES):
        started = time.thread_time()
        for _ in range(calls):
            run()
        best = min(best, time.thread_time() - started)
    return best / calls * 1e6


def show(what: str, us: float) -> None:
    print(f"{us:8.2f} us  {what}", file=sys.__stdout__, flush=True)


async def watcher(calls: int) -> float:
    """kvgate/http/proxy.py open_while_client_waits' watcher: a task started on a receive that
    waits (the client still there), then cancelled; less a turn of the loop without it."""
    loop = asyncio.get_running_loop()
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def with_watcher() -> None:
        for _ in range(calls):
            task = loop.create_task(watch())
            await asyncio.sleep(0)
            task.cancel()
        await asyncio.sleep(0)

    async def without() -> None:
        for _ in range(calls):
            await asyncio.sleep(0)
        await asyncio.sleep(0)

    best = float("inf")
    for _ in range(PASSES):
        started = time.thread_time()
        await with_watcher()
        middle = time.thread_time()
        await without()
        best = min(best, (middle - started) - (time.thread_time() - middle))
    return best / calls * 1e6


def quick_init(cls: type) -> Callable[..., None]:
    """A prototype __init__ for a frozen dataclass with plain fields: its __dict__ set in one call
    instead of one object.__setattr__ a field (what dataclasses generates for frozen=True)."""
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    defaults = {f"_d_{f.name}": f.default for f in fields if f.default is not dataclasses.MISSING}
    params = [f"{n}=_d_{n}" if f"_d_{n}" in defaults else n for n in names]
    body = ", ".join(f"{n!r}: {n}" for n in names)
    source = f"def __init__(self, {', '.join(params)}):\n    _set(self, '__dict__', {{{body}}})\n"
    namespace: dict[str, Any] = {"_set": object.__setattr__, **defaults}
    exec(source, namespace)
    init: Callable[..., None] = namespace["__init__"]
    return init


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-candidates-") as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        model_folder(folder)
        tok = LocalTokenizer(folder)
        bodies = chat_bodies(64)
        chats = [parse_request("chat", body, trust_request_chat_template=False).input for body in bodies]
        for chat in chats:  # the system prompt, the headers and these messages learned
            asyncio.run(tok.encode_chat(chat))
        body, chat = bodies[7], chats[7]
        rendered = tok.render_chat(chat)
        assert isinstance(rendered, str)
        segments = tok._segments
        assert segments is not None
        assert segments.pre_tokens is not None
        pre_tokens = segments.pre_tokens
        user = json.loads(body)["messages"][-1]["content"]
        rust = tok._rust
        show(
            f"parse_request, a {len(body)}-byte chat body",
            per_call(lambda: parse_request("chat", body, trust_request_chat_template=False), 3000),
        )
        show("render_chat of that chat", per_call(lambda: tok.render_chat(chat), 3000))
        show(
            "SegmentCache.encode of the rendered chat, every piece cached",
            per_call(lambda: segments.encode(rendered), 3000),
        )
        show(
            f"PreTokenCache.encode of its user message ({len(user)} chars, words known)",
            per_call(lambda: pre_tokens.encode(user), 3000),
        )
        show("  of it, the split regex's findall", per_call(lambda: pre_tokens._split.findall(user), 3000))
        show(
            "Rust encode_batch_fast of that user message",
            per_call(lambda: rust.encode_batch_fast([user], add_special_tokens=False), 1000),
        )

        settings = Settings(
            model=str(folder), max_num_batched_tokens=8192, max_model_len=32768, gpu_memory_bytes=85520809984
        )
        rt = Runtime(settings)  # as bench.stage_cpu builds it: the predictor from flags alone
        rt.configure_offline()
        config = rt.pipeline.config
        assert config is not None
        prepared = asyncio.run(prepare("chat", body, config.tokenizer, trust_request_chat_template=False, limits=None))
        predictor, (ids,) = config.predictor, prepared.prompts
        show(
            f"Predictor.predict of that chat ({len(ids)} prompt tokens)",
            per_call(lambda: predictor.predict(prepared.request, prepared.prompts), 3000),
        )
        block_size = predictor.layout.block_size
        show(
            "  of it, its prompt's block hashes (per request whatever the shape)",
            per_call(lambda: block_hashes(ids, block_size), 3000),
        )

        show("the exchange's watcher task: created, started, cancelled", uvloop.run(watcher(20000)))

        log = open(Path(tmp) / "decisions.log", "w")  # noqa: SIM115 - kept open for the lines below
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            configure_logging("info")
            logging.getLogger().handlers[0].setStream(sys.stderr)
            from kvgate.http.decision_log import write_line

            message = json.dumps({"request_id": "0" * 32, "decision": "admit", "reason": "fits", "kv_blocks": 10})
            line = f"2026-11-28 10:00:00,123 INFO kvgate.decision {message}\n".encode()
            show(
                f"decision line: write_line to a file (stderr's buffer: {type(sys.stderr.buffer).__name__})",
                per_call(lambda: write_line(message), 20000),
            )
            show("  its write system call alone (os.write)", per_call(lambda: os.write(2, line), 20000))
            show("  32 lines in one os.write, a line", per_call(lambda: os.write(2, line * 32), 2000) / 32)
        finally:
            os.dup2(saved, 2)
            log.close()

        args = (120, 16, (1, 2, 3), 5)
        show(
            "Demand(...) (kvgate/memory/demand.py, 20 fields, frozen)",
            per_call(lambda: Demand(*args, transient_prefill_bytes=4096), 50000),
        )
        fast = type("QuickDemand", (Demand,), {"__init__": quick_init(Demand)})
        assert dataclasses.astuple(fast(*args, transient_prefill_bytes=4096)) == dataclasses.astuple(
            Demand(*args, transient_prefill_bytes=4096)
        )
        show(
            "  the same with __dict__ set in one call (prototype)",
            per_call(lambda: fast(*args, transient_prefill_bytes=4096), 50000),
        )


if __name__ == "__main__":
    main()
