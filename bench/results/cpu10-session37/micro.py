"""Small parts of a request left as they are, each on this thread's CPU clock, the least of 7
passes of 20,000 calls: the decision log's check of its handler (kvgate/http/decision_log.py
`_only_handler`, once a line), kvgate's own request id (`request_id_of`), an admission line's
formatting (`admission_line`), and the three frozen dataclasses the parse builds once a request
(ValidRequest, SamplingParams, ChatInput, of the benchmark's chat) against unfrozen copies with
slots and the same fields. `PYTHONPATH=. taskset -c 1 python bench/results/cpu10-session37/micro.py`
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

from bench.overhead import chat_bodies
from bench.stage_cpu import least
from kvgate.http.decision_log import _only_handler, admission_line
from kvgate.http.gated_routes import request_id_of
from kvgate.logs import configure_logging
from kvgate.memory.demand import Demand
from kvgate.openai import parse_request


def least_us(run: Callable[[], object], calls: int = 20_000, passes: int = 7) -> float:
    """Per call, the least of `passes` passes of `calls` calls."""

    def calls_of() -> None:
        for _ in range(calls):
            run()

    return least(passes, calls_of) / calls * 1e6


def main() -> None:
    configure_logging("info")  # kvgate's own handler, as `kvgate serve` logs
    scope = {"headers": [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", b"100")]}
    demand = Demand(120, 16, tuple(range(8)), 5, transient_prefill_bytes=4096)
    print(f"_only_handler   {least_us(_only_handler):5.2f} us")
    print(f"request_id_of   {least_us(lambda: request_id_of(scope)):5.2f} us")
    line = lambda: admission_line("0123456789abcdef0123456789abcdef", "fits", demand, 0.0)  # noqa: E731
    print(f"admission_line  {least_us(line):5.2f} us")
    parsed = parse_request("chat", chat_bodies(1)[0])
    for made in (parsed.request, parsed.request.sampling, parsed.input):
        fields = {f.name: getattr(made, f.name) for f in dataclasses.fields(made)}
        cls = type(made)
        unfrozen = dataclasses.make_dataclass(cls.__name__, list(fields), slots=True)
        print(
            f"{cls.__name__:<15} {len(fields)} fields: frozen {least_us(partial(cls, **fields)):5.2f} us,"
            f" unfrozen with slots {least_us(partial(unfrozen, **fields)):5.2f} us"
        )


if __name__ == "__main__":
    main()
