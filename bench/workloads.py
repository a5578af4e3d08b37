"""Seeded traffic: Poisson arrivals in simulated seconds, realistic prompt and output mixes.

Every arm of a scenario replays the very same list of `Call`s (defined here): the list is
built once from the scenario's seed. Prompts are words of at most six letters, which the
simulator's stand-in tokenizer (and kvgate's /tokenize fallback) count as one token each.
"""

from __future__ import annotations

import base64
import io
import math
import random
from dataclasses import dataclass
from typing import Any

from demo.replay import WORDS  # one token each for the simulator's stand-in tokenizer


@dataclass(frozen=True)
class Call:
    """One request of a benchmark's traffic: when it is sent (seconds from the start), where,
    and what. (the demo sends its workloads in list order to a held engine instead.)"""

    at: float
    path: str
    body: dict[str, Any]
    label: str


MODEL = "llama-3.1-8b"


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def poisson_times(rng: random.Random, rate_per_s: float, duration_s: float, start_s: float = 0.0) -> list[float]:
    """Arrival times (simulated seconds) of a Poisson process."""
    out, t = [], start_s
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= start_s + duration_s:
            return out
        out.append(t)


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def chat_call(
    rng: random.Random,
    at: float,
    i: int,
    *,
    system: str | None = None,
    median_prompt: int = 400,
    max_prompt: int = 3000,
    max_tokens: tuple[int, ...] = (128, 256, 512, 1024),
    model: str = MODEL,
    **extra: Any,
) -> Call:
    """A chat turn: a lognormal prompt length (ShareGPT-like), a max_tokens users pick."""
    n = lognormal_int(rng, median_prompt, 0.8, 16, max_prompt)
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": f"Question {i}: " + words(rng, n)})
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": rng.choice(max_tokens),
        "temperature": 0.7,
        "seed": i,
        **extra,
    }
    return Call(at, "/v1/chat/completions", body, "chat")


def png_data_url(width: int, height: int, color: tuple[int, int, int]) -> str:
    """A one-colour PNG as a base64 data URL: a few kilobytes whatever its size, and each colour a
    different image (vLLM hashes the pixels: two requests share an encoder cache entry only if
    they send the same image)."""
    from PIL import Image  # Pillow: kvgate's own image header reader's dependency

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_chat_call(
    rng: random.Random, at: float, i: int, size: tuple[int, int], model: str, label: str = "image", **extra: Any
) -> Call:
    """A chat turn with one image (`size`: width, height) and a short question about it."""
    color = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
    content = [
        {"type": "image_url", "image_url": {"url": png_data_url(*size, color)}},
        {"type": "text", "text": f"Question {i}: " + words(rng, lognormal_int(rng, 40, 0.6, 8, 400))},
    ]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": rng.choice((64, 128, 256)),
        "temperature": 0.7,
        "seed": i,
        **extra,
    }
    return Call(at, "/v1/chat/completions", body, label)


def document_call(
    rng: random.Random,
    at: float,
    tokens: int,
    label: str = "document",
    max_tokens: int = 128,
    model: str = MODEL,
    **extra: Any,
) -> Call:
    body = {"model": model, "prompt": words(rng, tokens - 1), "max_tokens": max_tokens, "temperature": 0.0, **extra}
    return Call(at, "/v1/completions", body, label)


def streaming(calls: list[Call]) -> list[Call]:
    """Every request streams (TTFT is measured at the first event) and reports its usage."""
    for c in calls:
        c.body["stream"] = True
        c.body["stream_options"] = {"include_usage": True}
    return sorted(calls, key=lambda c: c.at)
