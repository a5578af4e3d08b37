"""`python -m bench.work_cost MODEL_DIR [--out DIR]`: the memory one body byte takes while kvgate
prepares it (parse, chat render, tokenize: kvgate/preparation.py), on the worst shapes of body.

Each body is prepared in a fresh process that has loaded the model folder's tokenizer, exactly as
a preparation worker does (kvgate/preparation_workers.py); the cost is that process's peak resident
memory (VmHWM) less what it held before the body arrived, divided by the body's size. No context
limit is given, so every prompt is tokenized whole (kvgate stops earlier when the context is
known). What kvgate/work_budget.py charges must stay above every peak measured here: parse and
render against preparation_cost(body), tokenize against what the tokenizer charged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

from demo.replay import WORDS
from kvgate.preparation_workers import status_bytes
from kvgate.units import MiB
from kvgate.work_budget import body_values, preparation_cost


def _text(chars: int, seed: int) -> str:
    words, size, i = [], 0, seed
    while size < chars:
        word = WORDS[(i * 7919) % len(WORDS)] + str(i % 97)
        words.append(word)
        size += len(word) + 1
        i += 1
    return " ".join(words)[:chars]


def hostile_bodies(model: str = "m") -> dict[str, tuple[str, bytes]]:
    """The issue's bodies (issue 28): route and raw JSON."""
    prompt = _text(29_000, 1)
    return {
        "1024 prompts x 29,000 chars": (
            "completions",
            json.dumps({"model": model, "prompt": [prompt] * 1024, "max_tokens": 4}).encode(),
        ),
        "110,000 function_call items (Responses)": (
            "responses",
            json.dumps(
                {
                    "model": model,
                    "input": [
                        {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
                        for i in range(110_000)
                    ],
                }
            ).encode(),
        ),
        "120,000 tool_calls in one chat message": (
            "chat",
            json.dumps(
                {
                    "model": model,
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {"id": f"t{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                                for i in range(120_000)
                            ],
                        },
                    ],
                }
            ).encode(),
        ),
        "160,000 tools": (
            "chat",
            json.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [
                        {"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(160_000)
                    ],
                }
            ).encode(),
        ),
        "200,000 Anthropic text blocks (/v1/messages)": (
            "messages",
            json.dumps(
                {
                    "model": model,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "a b"}] * 200_000}],
                }
            ).encode(),
        ),
        "50,000 chat messages": (
            "chat",
            json.dumps({"model": model, "messages": [{"role": "user", "content": "hello there"}] * 50_000}).encode(),
        ),
        "490,000 token ids": (
            "completions",
            json.dumps({"model": model, "prompt": [[7] * 478] * 1024, "max_tokens": 4}).encode(),
        ),
    }


def vm_bytes(field: str) -> int:
    """This process's `field` of its status (VmRSS, VmHWM), in bytes (Linux's procfs)."""
    found = status_bytes(os.getpid(), field.encode() + b":")
    if found is None:
        raise RuntimeError(field)
    return found


def reset_peak_rss() -> None:
    """Reset this process's peak resident memory (VmHWM) to what is resident now (Linux >= 4.0;
    procfs, not a disk: the write resets a counter in the kernel and never blocks)."""
    Path("/proc/self/clear_refs").write_text("5")


def _measure(model_dir: str, route: str, raw: bytes, out: Any) -> None:
    """In a fresh process: load the tokenizer, then prepare `raw` once, reading the peak of each
    stage: parse and render (up to the tokenizer's charge), then tokenize (against its charge)."""
    from kvgate.errors import KvgateError
    from kvgate.preparation import prepare
    from kvgate.tokens import local_tokenizer
    from kvgate.work_budget import charging

    tokenizer = local_tokenizer(model_dir)
    # Each stage's peak must be its own: VmHWM reset to what is resident now.
    reset_peak_rss()
    base = vm_bytes("VmRSS")
    stages: dict[str, int] = {}

    async def charged(cost: int) -> None:
        stages["parse_render_peak"] = vm_bytes("VmHWM") - base
        stages["tokenize_charge"] = cost
        reset_peak_rss()
        stages["tokenize_base"] = vm_bytes("VmRSS")

    started = time.perf_counter()
    outcome = "prepared"
    try:
        with charging(charged):
            prepared = asyncio.run(
                prepare(
                    route,
                    raw,
                    tokenizer,
                    trust_request_chat_template=False,
                    limits=None,
                )
            )
        outcome += f" ({sum(len(p) for p in prepared.prompts):,} tokens)"
    except KvgateError as error:
        outcome = f"refused: {error.code}"
    peak = vm_bytes("VmHWM")
    tokenize_peak = peak - stages["tokenize_base"] if "tokenize_base" in stages else 0
    if "parse_render_peak" not in stages:
        stages["parse_render_peak"] = peak - base
    out.send(
        {
            "parse_render_peak_bytes": stages["parse_render_peak"],
            "tokenize_peak_bytes": tokenize_peak,
            "tokenize_charge_bytes": stages.get("tokenize_charge", 0),
            "seconds": time.perf_counter() - started,
            "outcome": outcome,
        }
    )


def measure(model_dir: str) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    rows = []
    for name, (route, raw) in hostile_bodies().items():
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_measure, args=(model_dir, route, raw, send))
        child.start()
        result = receive.recv()
        child.join()
        rows.append(
            {
                "body": name,
                "route": route,
                "body_bytes": len(raw),
                **result,
                "parse_render_charge_bytes": preparation_cost(raw, body_values(raw)),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    rows = measure(args.model_dir)
    out = Path(args.out)
    (out / "work_cost.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "# Memory per body byte while kvgate prepares a body (bench/work_cost.py)",
        "",
        "Command: `python -m bench.work_cost MODEL_DIR`, MODEL_DIR the tests' tiny Llama folder "
        "(tests/support/tiny_model.py `build_tiny_model`: a BPE tokenizer of 2,048 entries). Parse and render: the peak before the tokenizer is charged, "
        "against kvgate/work_budget.py preparation_cost(body). Tokenize: the peak while tokenizing, "
        "against what the tokenizer charged before it started (kvgate/tokens.py `_encode`). No context "
        "limit: every text is tokenized whole.",
        "",
        "| body | route | body MiB | parse+render peak MiB | charged MiB | tokenize peak MiB | charged MiB | seconds | outcome |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['body']} | {r['route']} | {r['body_bytes'] / MiB:.1f} | {r['parse_render_peak_bytes'] / MiB:.0f} | "
        f"{r['parse_render_charge_bytes'] / MiB:.0f} | {r['tokenize_peak_bytes'] / MiB:.0f} | "
        f"{r['tokenize_charge_bytes'] / MiB:.0f} | {r['seconds']:.1f} | {r['outcome']} |"
        for r in rows
    ]
    (out / "work_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
