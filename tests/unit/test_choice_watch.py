"""Whether every choice of a multi-choice stream has started (kvgate/http/choice_watch.py),
on the event shapes vLLM 0.32.0 sends: chat's first role delta per choice (empty content) shows
nothing, a content delta or a finish reason does, and events may be split across chunks."""

from __future__ import annotations

import json

from kvgate.http.choice_watch import ChoiceWatch


def _chat(index: int, delta: dict, reason: str | None = None) -> bytes:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
    return b"data: " + json.dumps({"object": "chat.completion.chunk", "choices": [choice]}).encode() + b"\n\n"


def _text(index: int, text: str, reason: str | None = None) -> bytes:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
    return b"data: " + json.dumps({"object": "text_completion", "choices": [choice]}).encode() + b"\n\n"


class _Told:
    def __init__(self) -> None:
        self.started = 0

    def watch(self, choices: int) -> ChoiceWatch:
        return ChoiceWatch(choices, self._started)

    def _started(self) -> None:
        self.started += 1


def test_chat_role_deltas_sent_to_every_choice_at_the_first_output_show_nothing() -> None:
    told = _Told()
    watch = told.watch(3)
    watch.feed(b"".join(_chat(i, {"role": "assistant", "content": ""}) for i in range(3)))
    assert told.started == 0
    watch.feed(_chat(0, {"content": "Hi"}) + _chat(2, {"content": " there"}))
    assert told.started == 0
    watch.feed(_chat(1, {}, reason="length"))  # a finish reason shows its request ran
    assert told.started == 1
    watch.feed(_chat(0, {}, reason="stop") + _chat(2, {}, reason="stop") + b"data: [DONE]\n\n")
    assert told.started == 1  # told once


def test_an_event_split_across_chunks_counts_once_its_blank_line_came() -> None:
    told = _Told()
    watch = told.watch(2)
    both = _text(0, "a") + _text(1, "b", reason="length")
    started_at = []
    for i in range(len(both)):  # one byte a chunk
        watch.feed(both[i : i + 1])
        started_at.append(told.started)
    assert started_at.index(1) == len(both) - 1  # the second event's last byte
    assert told.started == 1


def test_an_empty_text_an_unknown_index_or_a_broken_event_shows_nothing() -> None:
    told = _Told()
    watch = told.watch(2)
    watch.feed(_text(0, "") + _text(5, "x", reason="stop") + b"data: {not json\n\n")
    watch.feed(_text(1, "y"))
    assert told.started == 0
    watch.feed(_text(0, "z"))
    assert told.started == 1
