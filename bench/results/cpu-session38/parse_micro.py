"""The parse of the benchmark's chats (bench.overhead.chat_bodies) in the tree on PYTHONPATH, and
a read of the parsed fields a prediction reads, on this thread's CPU clock, the least of 9 passes
over 2,000 chats: what kvgate/frozen_values.py's direct_init saves in building the parse's values
and what it costs in reading them (an instance with its own dict reads slower).

`PYTHONPATH=. taskset -c 0 python bench/results/cpu-session38/parse_micro.py`, from each tree.
"""

from __future__ import annotations

from bench.overhead import chat_bodies
from bench.stage_cpu import least
from kvgate.openai import parse_request
from kvgate.sampling_params import v2_filters

PASSES = 9
bodies = chat_bodies(2000)
parsed = [parse_request("chat", body) for body in bodies]


def parse() -> None:
    for body in bodies:
        parse_request("chat", body)


def read() -> None:
    fields: list[tuple[object, ...]] = []
    for p in parsed:
        r, s = p.request, p.request.sampling
        fields.append((r.model, r.stream, r.best_of, r.max_tokens_param, r.priority, r.cache_salt, r.prompts_from_text))
        fields.append((s.n, s.max_tokens, s.min_tokens, s.ignore_eos, s.temperature, s.logprobs, s.top_k, s.top_p))
        v2_filters(s)


print(
    f"parse {least(PASSES, parse) / len(bodies) * 1e6:6.2f} us   read {least(PASSES, read) / len(bodies) * 1e6:6.2f} us"
)
