"""The traffic vLLM has served, read off its own /metrics, for `kvgate advise --traffic-metrics`.

vLLM's request histograms (vllm 0.32.0 v1/metrics/loggers.py ``PrometheusStatLogger``:
``vllm:request_prompt_tokens``, ``vllm:request_params_max_tokens``,
``vllm:request_generation_tokens``, buckets 1-2-5 up to max_model_len) give each distribution
at bucket resolution: a percentile is the upper edge of the bucket it falls in, so "P99 <= 2,000"
is all the page says, never less. Parsed with prometheus_client's own text parser; samples of
every engine and model on the page are added up.

This is the offline half of issue #26's "from traffic"; kvgate's own record (kvgate/traffic_record.py,
`GET /advice`) gives the same distributions at finer buckets, and prompt + max_tokens per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvgate.advise_startup import Startup, predict

PROMPT = "vllm:request_prompt_tokens"
MAX_TOKENS = "vllm:request_params_max_tokens"
GENERATION = "vllm:request_generation_tokens"
QUANTILES = (0.5, 0.95, 0.99)


@dataclass(frozen=True)
class Distribution:
    """One histogram: cumulative counts per upper bucket edge (the last edge is +Inf)."""

    edges: tuple[float, ...]
    cumulative: tuple[float, ...]

    @property
    def count(self) -> int:
        return int(self.cumulative[-1]) if self.cumulative else 0

    def quantile(self, q: float) -> float:
        """The upper edge of the bucket holding the q-quantile (inf past the last finite edge)."""
        wanted = q * self.count
        for edge, seen in zip(self.edges, self.cumulative, strict=True):
            if seen >= wanted:
                return edge
        return math.inf

    @property
    def max_bound(self) -> float:
        """The upper edge of the highest bucket with an observation."""
        return self.quantile(1.0)

    def share_above(self, tokens: int) -> tuple[float, float]:
        """The share of observations above `tokens`, between two bounds at bucket resolution:
        the buckets that lie wholly above it, and every bucket reaching above it."""
        if not self.count:
            return 0.0, 0.0
        lower = upper = 0.0
        previous_edge, previous_seen = 0.0, 0.0
        for edge, seen in zip(self.edges, self.cumulative, strict=True):
            in_bucket = seen - previous_seen
            if previous_edge >= tokens:
                lower += in_bucket
            if edge > tokens:
                upper += in_bucket
            previous_edge, previous_seen = edge, seen
        return lower / self.count, upper / self.count

    def summary(self) -> dict[str, float | int | None]:
        def bound(value: float) -> float | None:
            return None if math.isinf(value) else value

        return {
            "count": self.count,
            **{f"p{round(q * 100)}_at_most": bound(self.quantile(q)) for q in QUANTILES},
            "max_at_most": bound(self.max_bound),
        }


@dataclass(frozen=True)
class Traffic:
    prompt: Distribution
    max_tokens: Distribution
    generation: Distribution
    # prompt + max_tokens of each request: kvgate's record has it, vLLM's page does not
    requests: Distribution | None = None

    @property
    def request_tokens(self) -> int | None:
        """The length a P99 request may reach (bucket edges): the P99 of prompt + max_tokens where
        it was recorded, else P99 prompt + P99 max_tokens."""
        if self.requests is not None:
            total = self.requests.quantile(0.99)
        else:
            total = self.prompt.quantile(0.99) + self.max_tokens.quantile(0.99)
        return None if math.isinf(total) or not self.prompt.count else int(total)

    @property
    def typical_request_tokens(self) -> int | None:
        """The median request's prompt + max_tokens (bucket edges): what sizes --max-num-seqs.
        vLLM gives blocks as tokens come and preempts when the pool runs dry (no OOM), so capping
        the running sequences at what the pool holds of P99 requests would idle it for the rest:
        on the simulator, Mistral-7B's chat with a burst of 16k-token prompts served less goodput
        at the 28 sequences of its P99 than at 200 (bench/advised.py, story mnbt-200000)."""
        if self.requests is not None:
            total = self.requests.quantile(0.5)
        else:
            total = self.prompt.quantile(0.5) + self.max_tokens.quantile(0.5)
        return None if math.isinf(total) or not self.prompt.count else int(total)


def read_page(source: str) -> str:
    """A /metrics page from a URL or a file (OSError, httpx.HTTPError: not readable)."""
    if source.startswith(("http://", "https://")):
        response = httpx.get(source, timeout=10)
        response.raise_for_status()
        return response.text
    return Path(source).read_text()


def parse_traffic(text: str) -> Traffic:
    """vLLM's three request histograms (ValueError: the page has none of them)."""
    buckets: dict[str, dict[float, float]] = {PROMPT: {}, MAX_TOKENS: {}, GENERATION: {}}
    for family in text_string_to_metric_families(text):
        if family.name not in buckets:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                edge = float(sample.labels["le"])
                buckets[family.name][edge] = buckets[family.name].get(edge, 0.0) + sample.value
    if not buckets[PROMPT]:
        raise ValueError(f"the page has no {PROMPT} histogram: give vLLM's own /metrics (vLLM V1)")

    def distribution(name: str) -> Distribution:
        edges = tuple(sorted(buckets[name]))
        return Distribution(edges, tuple(buckets[name][e] for e in edges))

    return Traffic(distribution(PROMPT), distribution(MAX_TOKENS), distribution(GENERATION))


@dataclass(frozen=True)
class LengthRow:
    """One --max-model-len against the traffic: whether vLLM starts, what its pool holds, and the
    share of past prompts it could not have served."""

    max_model_len: int
    fits: bool
    max_concurrency: float  # vLLM's "Maximum concurrency" line at this length
    p99_requests: int | None  # requests of P99 prompt + P99 max_tokens the pool holds
    prompts_longer: tuple[float, float]  # share of past prompts above it (bucket bounds)


def capacity_table(startup: Startup, traffic: Traffic) -> list[LengthRow]:
    """The table an operator builds by hand: for powers of two from 2,048 to the model's context
    and the P99 request's length, what vLLM's start-up gives (the same prediction, re-run)."""
    longest = startup.layout.geometry.max_position_embeddings or startup.max_model_len
    lengths = {2**k for k in range(11, 31) if 2**k <= longest} | {startup.max_model_len}
    if traffic.request_tokens is not None and traffic.request_tokens <= longest:
        lengths.add(-(-traffic.request_tokens // 256) * 256)
    rows = []
    for length in sorted(lengths):
        s = predict(replace(startup.request, max_model_len=length))
        held = None
        if traffic.request_tokens and s.sized_the_pool:
            held = s.capacity.num_blocks * s.block_size // traffic.request_tokens
        rows.append(
            LengthRow(
                length,
                s.fits,
                round(s.capacity.max_concurrency, 2) if s.sized_the_pool else 0.0,
                held,
                traffic.prompt.share_above(length),
            )
        )
    return rows
