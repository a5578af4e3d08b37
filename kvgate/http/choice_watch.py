"""Whether every choice of a stream of several engine requests has started, read off its events.

A request with n > 1 (or several prompts) is one engine request per choice (vllm 0.32.0
v1/engine/parallel_sampling.py `ParentRequest`; entrypoints/openai/completion/serving.py
`_create_completion`), each prefilled when the scheduler takes it. Its stream's first token is
one of theirs, so the ledger keeps the request's prefill terms open on vLLM's count of first
tokens (kvgate/gate/plain_prefills.py), a count that relieves a candidate only once every
candidate's every child may have started. But each event names its choice (`index`), and a
choice's text, delta or finish reason only comes from its own engine request's outputs
(v1/engine/output_processor.py, one RequestState per child, whose outputs reach the stream after
the engine step that made them): once every index has shown one, every child has prefilled and
the request's prefill terms are over.

Its finished choices' sampled rows are not given back (session 38): the ledger keeps charging all
its rows until the request ends. Giving them back closed S8's dip in running requests but ran
S8's simulated engine out of memory in the first run (an fp32 logits copy of 306 rows, 177.5 MiB,
against 174.2 MiB free and 195.1 MiB cached in fragments). Which history did it is not known:
the one-step histories of up to 48 rows more tried since run at every count kvgate would then
admit (bench/results/s8-session38/rows_fall.py); the sampler phase's replay plays earlier steps
of the same or fewer rows only (kvgate/memory/activation.py `sampler_phase_overhead_bytes`).

Not a chat stream's first event per choice: on the stream's first output vLLM sends every index
a role delta with empty content (entrypoints/openai/chat_completion/serving.py
`chat_completion_stream_generator`, `first_iteration`), before most children have run. Nor a
chat request's `echo`, which that same first iteration sends every index: the caller leaves those
streams to the count.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

_SEPARATOR = b"\n\n"
_DATA = b"data: {"


def _shows_token(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries its engine request's output: text, a delta other than the
    role, logprobs or a finish reason."""
    if choice.get("finish_reason") is not None or choice.get("text") or choice.get("logprobs"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(value for key, value in delta.items() if key != "role")


class ChoiceWatch:
    """Feed it a stream's chunks: `on_all_started()` once every one of `choices` indices showed a
    token; after that feeding costs nothing."""

    def __init__(self, choices: int, on_all_started: Callable[[], None]) -> None:
        self.choices = choices
        self._on_all_started: Callable[[], None] | None = on_all_started
        self._started: set[int] = set()
        self._pending = b""  # an event not yet ended by its blank line

    def feed(self, chunk: bytes) -> None:
        if self._on_all_started is None:
            return
        events = (self._pending + chunk).split(_SEPARATOR)
        self._pending = events.pop()
        for event in events:
            if not event.startswith(_DATA):
                continue
            try:
                body = json.loads(event[len(_DATA) - 1 :])
            except ValueError:
                continue
            for choice in (body.get("choices") or ()) if isinstance(body, dict) else ():
                index = choice.get("index") if isinstance(choice, dict) else None
                if isinstance(index, int) and 0 <= index < self.choices and _shows_token(choice):
                    self._started.add(index)
        if len(self._started) == self.choices:
            self._on_all_started()
            self._on_all_started = None
            self._pending = b""
