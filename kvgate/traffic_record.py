"""What kvgate has served, kept for `GET /advice` (issue #26, "from traffic").

Per route: the prompt, max_tokens, prompt + max_tokens and output lengths, how many requests ask
for n > 1, logprobs or prompt logprobs; over all routes: the share of prompt blocks already held by
requests in flight when a request was admitted (prefix reuse), refusals by reason, queue waits by
the reason the request queued, the largest transient memory reserved (and the transient budget
then), and the largest KV demand (reserved + queued) against the pool.

Memory is bounded whatever the traffic: every length goes into a fixed histogram
(`Histogram`: 16 buckets per power of two, so a percentile is an upper bound within 4.4 %),
never a list per request; the routes are vLLM's (a fixed set) and the reasons kvgate's error codes.
The only per-request state is the reason of each request now in the queue, dropped when it leaves
(and capped, should a request id repeat). Each event costs a few bisects and dictionary updates.

It is one of the gate's observers (decisions and releases), told by the gated routes what each
evaluated request asked for and how long each answer was.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from kvgate.advise_traffic import Distribution, Traffic
from kvgate.errors import KvNeverFits
from kvgate.gate.gate import Gate
from kvgate.gate.ledger import Reservation
from kvgate.gate.observer import Decision, Release
from kvgate.predict import Prediction


def _log_edges(first: float, last: float, per_octave: int) -> tuple[float, ...]:
    k_last = math.ceil(per_octave * math.log2(last / first))
    return tuple(first * 2 ** (k / per_octave) for k in range(k_last + 1))


# Token counts: every integer up to 16, then 16 buckets per power of two up to 2^25 tokens.
TOKEN_EDGES: tuple[float, ...] = tuple(sorted({float(math.ceil(e)) for e in _log_edges(1, 2**25, 16)}))
# Seconds: 1 ms to about 2 hours, 8 buckets per power of two.
SECOND_EDGES: tuple[float, ...] = _log_edges(0.001, 8192, 8)
# A request id queued and never heard of again (ids may repeat) is forgotten past this many.
MAX_QUEUED_TRACKED = 65536


class Histogram:
    """Counts per bucket (upper edges inclusive, a last bucket for anything above)."""

    __slots__ = ("counts", "edges")

    def __init__(self, edges: tuple[float, ...]) -> None:
        self.edges = edges
        self.counts = [0] * (len(edges) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1

    @property
    def count(self) -> int:
        return sum(self.counts)

    def distribution(self) -> Distribution:
        """As advise's Distribution: cumulative counts per upper edge, +inf last."""
        cumulative, seen = [], 0
        for c in self.counts:
            seen += c
            cumulative.append(float(seen))
        return Distribution((*self.edges, math.inf), tuple(cumulative))


def sparse(d: Distribution) -> dict[str, list[float]]:
    """A distribution as JSON: only the edges that bound a bucket holding something (its upper
    edge, where the count grows, and its lower edge), so that every bound read back is the same."""
    edges, cumulative = [], []
    counts = d.cumulative
    for i, (edge, seen) in enumerate(zip(d.edges, counts, strict=True)):
        grows = seen != (counts[i - 1] if i else 0.0)
        next_grows = i + 1 < len(counts) and counts[i + 1] != seen
        if grows or next_grows:
            edges.append(edge if not math.isinf(edge) else -1.0)
            cumulative.append(seen)
    return {"le": edges, "cumulative": cumulative}


def from_sparse(doc: dict[str, list[float]]) -> Distribution:
    """The inverse of `sparse` (-1 stands for +inf). ValueError: not that shape."""
    edges = [math.inf if e == -1 else float(e) for e in doc["le"]]
    cumulative = [float(c) for c in doc["cumulative"]]
    if len(edges) != len(cumulative) or edges != sorted(edges) or cumulative != sorted(cumulative):
        raise ValueError("a histogram needs as many edges as counts, both increasing")
    if not edges or not math.isinf(edges[-1]):
        edges.append(math.inf)
        cumulative.append(cumulative[-1] if cumulative else 0.0)
    return Distribution(tuple(edges), tuple(cumulative))


@dataclass
class RouteTraffic:
    """One route's requests."""

    prompt: Histogram = field(default_factory=lambda: Histogram(TOKEN_EDGES))
    max_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_EDGES))
    request: Histogram = field(default_factory=lambda: Histogram(TOKEN_EDGES))  # prompt + max_tokens
    output: Histogram = field(default_factory=lambda: Histogram(TOKEN_EDGES))  # completed answers
    n_above_one: int = 0
    logprobs: int = 0
    prompt_logprobs: int = 0


@dataclass(frozen=True)
class Measured:
    """A snapshot of the record (or its JSON read back): what `kvgate advise` weighs."""

    seconds: float
    routes: dict[str, dict[str, Any]]  # route -> {requests, n_above_one, logprobs, prompt_logprobs}
    prompt: dict[str, Distribution]  # per route
    max_tokens: dict[str, Distribution]
    request: dict[str, Distribution]
    output: dict[str, Distribution]
    prefix_blocks: int  # full prompt blocks of admitted requests
    prefix_blocks_in_flight: int  # of them, held by a request in flight when admitted
    refusals: dict[str, int]
    queue_waits: dict[str, Distribution]  # by the reason the request queued
    peak_transient_bytes: int
    transient_budget_at_peak: int | None
    peak_kv_demand_blocks: int  # reserved + queued, at its highest
    never_fits_kv_blocks: int  # the largest request refused as kv_cache_never_fits
    kv_pool_blocks: int | None

    def merged(self, name: str) -> Distribution:
        """One distribution (`prompt`, `max_tokens`, `request`, `output`) over every route."""
        per_route: dict[str, Distribution] = getattr(self, name)
        dists = list(per_route.values())
        if not dists:
            return Histogram(TOKEN_EDGES).distribution()
        edges = tuple(sorted({e for d in dists for e in d.edges}))
        cumulative = tuple(float(sum(_at(d, e) for d in dists)) for e in edges)
        return Distribution(edges, cumulative)

    def traffic(self) -> Traffic:
        """Every route's requests together, as advise reads vLLM's histograms."""
        return Traffic(self.merged("prompt"), self.merged("max_tokens"), self.merged("output"), self.merged("request"))

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 1),
            "routes": {
                route: {
                    **counts,
                    "prompt_tokens": self.prompt[route].summary(),
                    "max_tokens": self.max_tokens[route].summary(),
                    "request_tokens": self.request[route].summary(),
                    "output_tokens": self.output[route].summary(),
                    "histograms": {
                        "prompt_tokens": sparse(self.prompt[route]),
                        "max_tokens": sparse(self.max_tokens[route]),
                        "request_tokens": sparse(self.request[route]),
                        "output_tokens": sparse(self.output[route]),
                    },
                }
                for route, counts in self.routes.items()
            },
            "prefix_reuse": {
                "prompt_blocks": self.prefix_blocks,
                "held_in_flight": self.prefix_blocks_in_flight,
                "share": round(self.prefix_blocks_in_flight / self.prefix_blocks, 4) if self.prefix_blocks else 0.0,
            },
            "refusals": dict(self.refusals),
            "queue_waits": {
                reason: {
                    **{k.replace("_at_most", "_s_at_most"): v for k, v in d.summary().items()},
                    "histogram": sparse(d),
                }
                for reason, d in self.queue_waits.items()
            },
            "peak_transient_bytes": self.peak_transient_bytes,
            "transient_budget_at_peak_bytes": self.transient_budget_at_peak,
            "peak_kv_demand_blocks": self.peak_kv_demand_blocks,
            "never_fits_kv_blocks": self.never_fits_kv_blocks,
            "kv_pool_blocks": self.kv_pool_blocks,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Measured:
        """What `GET /advice` printed (KeyError, ValueError, TypeError: not that document)."""
        routes = doc["routes"]
        counts_keys = ("requests", "n_above_one", "logprobs", "prompt_logprobs")

        def per_route(name: str) -> dict[str, Distribution]:
            return {route: from_sparse(r["histograms"][name]) for route, r in routes.items()}

        return cls(
            seconds=float(doc["seconds"]),
            routes={route: {k: int(r[k]) for k in counts_keys} for route, r in routes.items()},
            prompt=per_route("prompt_tokens"),
            max_tokens=per_route("max_tokens"),
            request=per_route("request_tokens"),
            output=per_route("output_tokens"),
            prefix_blocks=int(doc["prefix_reuse"]["prompt_blocks"]),
            prefix_blocks_in_flight=int(doc["prefix_reuse"]["held_in_flight"]),
            refusals={str(k): int(v) for k, v in doc["refusals"].items()},
            queue_waits={str(k): from_sparse(v["histogram"]) for k, v in doc["queue_waits"].items()},
            peak_transient_bytes=int(doc["peak_transient_bytes"]),
            transient_budget_at_peak=_optional_int(doc["transient_budget_at_peak_bytes"]),
            peak_kv_demand_blocks=int(doc["peak_kv_demand_blocks"]),
            never_fits_kv_blocks=int(doc["never_fits_kv_blocks"]),
            kv_pool_blocks=_optional_int(doc["kv_pool_blocks"]),
        )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _at(d: Distribution, edge: float) -> float:
    """The cumulative count of `d` at `edge` (the last edge of `d` at or below it)."""
    i = bisect.bisect_right(d.edges, edge)
    return d.cumulative[i - 1] if i else 0.0


class TrafficRecord:
    """The running record (see the module docstring). `watch(gate)` before the first request."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._started = clock()
        self._routes: dict[str, RouteTraffic] = {}
        self._queued: dict[str, tuple[str, int]] = {}  # request id -> (why it queued, its KV blocks)
        self._queued_blocks = 0
        self._waits: dict[str, Histogram] = {}
        self.refusals: dict[str, int] = {}
        self.prefix_blocks = 0
        self.prefix_blocks_in_flight = 0
        self.peak_transient_bytes = 0
        self.transient_budget_at_peak: int | None = None
        self.peak_kv_demand_blocks = 0
        self.never_fits_kv_blocks = 0
        self._gate: Gate[Any] | None = None

    def watch(self, gate: Gate[Any]) -> None:
        """The gate whose ledger and budget the peaks are read from."""
        self._gate = gate

    def _route(self, route: str) -> RouteTraffic:
        r = self._routes.get(route)
        if r is None:
            r = self._routes[route] = RouteTraffic()
        return r

    def evaluated(self, route: str, prediction: Prediction) -> None:
        """A request kvgate read and predicted (admitted, queued or refused by the gate later)."""
        r = self._route(route)
        prompt, new = prediction.prompt_tokens, prediction.max_new_tokens
        r.prompt.observe(prompt)
        r.max_tokens.observe(new)
        r.request.observe(prompt + new)
        sampling = prediction.sampling
        if sampling.n > 1 or (sampling.best_of or 1) > 1:
            r.n_above_one += 1
        if sampling.logprobs is not None:
            r.logprobs += 1
        if sampling.prompt_logprobs is not None:
            r.prompt_logprobs += 1

    def finished(self, route: str, outcome: str, output_tokens: int | None) -> None:
        """An answer relayed to its end; `output_tokens` when the relay counted them."""
        if outcome == "completed" and output_tokens is not None:
            self._route(route).output.observe(output_tokens)

    def decided(self, decision: Decision) -> None:
        kind = decision.kind
        if kind == "queue":
            blocks = decision.demand.kv_blocks if decision.demand is not None else 0
            self._forget(decision.request_id)
            if len(self._queued) >= MAX_QUEUED_TRACKED:  # the oldest, never heard of again
                self._forget(next(iter(self._queued)))
            self._queued[decision.request_id] = (decision.reason, blocks)
            self._queued_blocks += blocks
            self._note_kv_demand()
            return
        queued = self._forget(decision.request_id)
        if kind == "reject":
            self.refusals[decision.reason] = self.refusals.get(decision.reason, 0) + 1
            if isinstance(decision.error, KvNeverFits):
                self.never_fits_kv_blocks = max(self.never_fits_kv_blocks, decision.error.needed)
        elif kind == "admit":
            if queued is not None:
                waits = self._waits.get(queued)
                if waits is None:
                    waits = self._waits[queued] = Histogram(SECOND_EDGES)
                waits.observe(decision.queue_wait_s)
            if decision.reservation is not None:
                self._admitted(decision.reservation)

    def _forget(self, request_id: str) -> str | None:
        """Drop a request from the queued ones; why it had queued (None: it had not)."""
        entry = self._queued.pop(request_id, None)
        if entry is None:
            return None
        self._queued_blocks -= entry[1]
        return entry[0]

    def _admitted(self, reservation: Reservation) -> None:
        """Read off what the gate's ledger counted as it reserved (the admission reports it at once)."""
        if self._gate is None:
            return
        self.prefix_blocks += len(reservation.hashes)
        self.prefix_blocks_in_flight += reservation.shared_blocks_at_admission
        transient = reservation.transient_bytes_at_admission
        if transient > self.peak_transient_bytes:
            self.peak_transient_bytes = transient
            self.transient_budget_at_peak = self._gate.budget.transient_limit()
        self._note_kv_demand()

    def _note_kv_demand(self) -> None:
        if self._gate is not None:
            demand = self._gate.ledger.kv_blocks + self._queued_blocks
            if demand > self.peak_kv_demand_blocks:
                self.peak_kv_demand_blocks = demand

    def released(self, release: Release) -> None:
        """Releases are read through `finished`, which knows the route."""

    def snapshot(self) -> Measured:
        routes = self._routes
        return Measured(
            seconds=self._clock() - self._started,
            routes={
                name: {
                    "requests": r.prompt.count,
                    "n_above_one": r.n_above_one,
                    "logprobs": r.logprobs,
                    "prompt_logprobs": r.prompt_logprobs,
                }
                for name, r in routes.items()
            },
            prompt={name: r.prompt.distribution() for name, r in routes.items()},
            max_tokens={name: r.max_tokens.distribution() for name, r in routes.items()},
            request={name: r.request.distribution() for name, r in routes.items()},
            output={name: r.output.distribution() for name, r in routes.items()},
            prefix_blocks=self.prefix_blocks,
            prefix_blocks_in_flight=self.prefix_blocks_in_flight,
            refusals=dict(self.refusals),
            queue_waits={reason: h.distribution() for reason, h in self._waits.items()},
            peak_transient_bytes=self.peak_transient_bytes,
            transient_budget_at_peak=self.transient_budget_at_peak,
            peak_kv_demand_blocks=self.peak_kv_demand_blocks,
            never_fits_kv_blocks=self.never_fits_kv_blocks,
            kv_pool_blocks=self._gate.budget.kv_blocks if self._gate is not None else None,
        )
