"""How many tokens a relayed completion produced, read off the bytes on their way through.

kvgate learns output lengths from finished requests (kvgate/output_lengths.py), and kvgate relays
bodies untouched, so it counts without parsing them: a JSON body ends with vLLM's usage block
(exact), and a stream is one `data: {...}` event per generated token and sequence unless the
client asked for a usage chunk (exact again). Counting events over-counts by a role or a finish
event per sequence on chat streams; that errs towards larger reservations.
"""

from __future__ import annotations

import re

_EVENT = b"data: {"
_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TAIL = 512  # bytes kept from the end of the body: vLLM's usage block fits in far less


class OutputTokenCounter:
    """Feed it every chunk of a response body; `tokens()` at the end."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.events = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if self.stream:
            # fewer bytes than the marker carried over: a marker split across chunks counts once
            self.events += (self._tail[1 - len(_EVENT) :] + chunk).count(_EVENT)
        self._tail = (self._tail + chunk)[-_TAIL:]

    def tokens(self) -> int | None:
        """Tokens generated (all sequences): the usage block's if the body has one, else the
        stream's events; None for a JSON body without usage."""
        found = _USAGE.findall(self._tail)
        if found:
            return int(found[-1])
        return self.events if self.stream else None
