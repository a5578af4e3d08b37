"""Advice from the traffic kvgate has measured (`GET /advice`, `kvgate advise --from URL`).

The same start-up prediction and proposals as `kvgate advise` (kvgate/advise_startup.py,
kvgate/advise_flags.py), and the same table of --max-model-len (kvgate/advise_traffic.py), fed with
the running deployment's flags and what kvgate recorded (kvgate/traffic_record.py) instead of a
command line and vLLM's /metrics. On top: a --max-model-len that holds every request seen, and
what each proposed configuration would have done to the refusals and queue waits kvgate saw,
judged by the same arithmetic (pool blocks against the largest KV demand seen, the start-up's
headroom against the largest transient reservation), not by a replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from kvgate.advise_flags import Recommendation, apply, gib, recommend, serving_failure
from kvgate.advise_startup import Failure, Request, Startup, predict
from kvgate.advise_traffic import LengthRow, Traffic, capacity_table
from kvgate.engine_config import Deployment, EngineFlags
from kvgate.gate.budget import KV_BUSY, TRANSIENT_BUSY
from kvgate.traffic_record import Measured

# A proposed --max-model-len is the longest request seen rounded up to this many tokens.
LENGTH_STEP = 256


def request_for(flags: EngineFlags, deployment: Deployment, gpu: str) -> Request:
    """The advise input a running deployment amounts to: vLLM's resolved flags (the backend's
    report over kvgate's flags), the model folder and the GPU (its total, as a size)."""
    if not flags.model:
        raise ValueError("kvgate was started without --model: advise needs the model's config.json")
    return Request(
        model=flags.model,
        gpu=gpu,
        vllm_version=deployment.runtime.version,
        max_model_len=deployment.max_model_len,
        max_num_batched_tokens=deployment.max_num_batched_tokens,
        max_num_seqs=deployment.max_num_seqs,
        gpu_memory_utilization=deployment.gpu_memory_utilization,
        kv_cache_memory_bytes=deployment.kv_cache_memory_bytes,
        tensor_parallel_size=deployment.tensor_parallel_size,
        pipeline_parallel_size=deployment.pipeline_parallel_size,
        kv_cache_dtype=deployment.kv_cache_dtype,
        block_size=deployment.block_size,
        enforce_eager=deployment.enforce_eager,
        model_runner=flags.model_runner,
        sampler=flags.sampler,
        speculative_method=flags.speculative_method,
        speculative_model=flags.speculative_model,
        num_speculative_tokens=flags.num_speculative_tokens,
    )


def request_json(request: Request) -> dict[str, Any]:
    return {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in vars(request).items()  # a frozen dataclass's fields, in order
    }


def request_from_json(doc: dict[str, Any], **overrides: Any) -> Request:
    """The Request `request_json` wrote (TypeError: unknown fields), with the given overrides."""
    fields = {**doc, **{k: v for k, v in overrides.items() if v is not None}}
    if fields.get("cudagraph_capture_sizes") is not None:
        fields["cudagraph_capture_sizes"] = tuple(fields["cudagraph_capture_sizes"])
    return Request(**fields)


@dataclass(frozen=True)
class Effect:
    """What one configuration would have done to the traffic kvgate saw."""

    label: str  # "as deployed", "advised", "max_model_len 4,096"
    max_model_len: int
    starts: bool
    pool_blocks: int | None
    refused_too_long: tuple[float, float]  # share of past requests over max_model_len (bucket bounds)
    kv_waits: int  # requests that waited for KV blocks
    kv_waits_avoided: bool  # its pool holds the largest KV demand seen (reserved + queued)
    never_fits: int  # refused as larger than the pool
    never_fits_served: bool  # its pool holds the largest of them
    transient_waits: int
    transient_headroom_change: int | None  # bytes a step gains (+) or loses (-) against the deployment

    def sentence(self, measured: Measured) -> str:
        if not self.starts:
            return f"{self.label}: vLLM would not start"
        low, high = self.refused_too_long
        total = sum(r["requests"] for r in measured.routes.values())
        share = f"{100 * low:.1f}%" if low == high else f"{100 * low:.1f}-{100 * high:.1f}%"
        parts = [f"refuses {share} of the {total:,} requests seen as longer than {self.max_model_len:,} tokens"]
        if self.kv_waits:
            verdict = "would have been admitted on arrival" if self.kv_waits_avoided else "would still have waited"
            parts.append(
                f"{_plural(self.kv_waits, 'request')} waited for KV blocks: with {self.pool_blocks:,} blocks (the largest "
                f"demand seen: {measured.peak_kv_demand_blocks:,}) they {verdict}"
            )
        if self.never_fits:
            verdict = "would have been served" if self.never_fits_served else "would still be refused"
            parts.append(f"{_plural(self.never_fits, 'request')} refused as larger than the pool {verdict}")
        if self.transient_waits and self.transient_headroom_change is not None:
            parts.append(
                f"{_plural(self.transient_waits, 'request')} waited for transient memory: a step has "
                f"{gib(self.transient_headroom_change)} {'more' if self.transient_headroom_change >= 0 else 'less'}"
            )
        return f"{self.label}: " + "; ".join(parts)


@dataclass(frozen=True)
class LiveAdvice:
    measured: Measured
    startup: Startup
    serving: Failure | None
    advised: Startup
    recommended: list[Recommendation]
    traffic: Traffic
    table: list[LengthRow]
    effects: list[Effect]


def longest_request_length(s: Startup, traffic: Traffic) -> int | None:
    """The longest request seen (prompt + max_tokens, at bucket resolution) rounded up to
    LENGTH_STEP, within the model's context; None when nothing was seen."""
    requests = traffic.requests
    if requests is None or not requests.count:
        return None
    longest = requests.max_bound
    context = s.layout.geometry.max_position_embeddings or s.max_model_len
    if math.isinf(longest):
        return context
    return min(context, -(-int(longest) // LENGTH_STEP) * LENGTH_STEP)


def _max_model_len(s: Startup, fixed: Startup, traffic: Traffic) -> Recommendation | None:
    """--max-model-len from the requests seen: the longest, where it differs from the deployment's
    and vLLM starts with it beside the other fixes (`fixed`: the start-up with the flags that
    fix its failures, kvgate/advise_flags.py)."""
    length = longest_request_length(s, traffic)
    if length is None or length == s.max_model_len:
        return None
    if not predict(replace(fixed.request, max_model_len=length)).fits:
        return None
    assert traffic.requests is not None
    low, high = traffic.requests.share_above(length)
    was_low, was_high = traffic.requests.share_above(s.max_model_len)
    return Recommendation(
        "--max-model-len",
        length,
        f"the longest request seen (prompt + max_tokens) is at most {traffic.requests.max_bound:,.0f} tokens: "
        f"{length:,} would have refused {100 * low:.1f}-{100 * high:.1f}% of them "
        f"({s.max_model_len:,}: {100 * was_low:.1f}-{100 * was_high:.1f}%)",
    )


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def effect(
    label: str, s: Startup, measured: Measured, deployed: Startup, traffic: Traffic, running: bool = False
) -> Effect:
    """`s` against the traffic seen. Its pool is the one kvgate measured (vLLM's own report),
    scaled by the change the prediction makes: a pool the prediction misses by some amount (an
    override, another process) is missed the same way with the other flags. `running`: `s` is the
    deployment itself, which started whatever the prediction says, with the pool vLLM reported."""
    waits = {reason: d.count for reason, d in measured.queue_waits.items()}
    pool = s.capacity.num_blocks if s.sized_the_pool and s.fits else None
    if running and measured.kv_pool_blocks:
        pool = measured.kv_pool_blocks
    elif pool is not None and measured.kv_pool_blocks and deployed.fits and deployed.capacity.num_blocks:
        pool = measured.kv_pool_blocks * pool // deployed.capacity.num_blocks
    requests = traffic.requests if traffic.requests is not None else traffic.prompt
    headroom = s.serving_headroom - deployed.serving_headroom if s.fits and deployed.fits else None
    return Effect(
        label=label,
        max_model_len=s.max_model_len,
        starts=running or s.fits,
        pool_blocks=pool,
        refused_too_long=requests.share_above(s.max_model_len),
        kv_waits=waits.get(KV_BUSY, 0),
        kv_waits_avoided=pool is not None and pool >= measured.peak_kv_demand_blocks,
        never_fits=measured.refusals.get("kv_cache_never_fits", 0),
        never_fits_served=pool is not None and pool >= measured.never_fits_kv_blocks,
        transient_waits=waits.get(TRANSIENT_BUSY, 0) + measured.refusals.get("transient_memory_never_fits", 0),
        transient_headroom_change=headroom,
    )


def advise_from(request: Request, measured: Measured, other_processes_bytes: int = 0) -> LiveAdvice:
    """The advice for this deployment and this traffic (ValueError, KeyError: bad input)."""
    traffic = measured.traffic()
    startup = predict(request)
    fixed, _ = recommend(startup, traffic.typical_request_tokens, other_processes_bytes)
    length = _max_model_len(startup, fixed, traffic)
    base = predict(replace(request, max_model_len=int(length.value))) if length else startup
    advised, recommended = recommend(base, traffic.typical_request_tokens, other_processes_bytes)
    if length is not None and all(r.flag != length.flag for r in recommended):
        recommended.insert(0, length)
    table = capacity_table(startup, traffic)
    effects = [
        effect("as deployed", startup, measured, startup, traffic, running=True),
        effect("advised", predict(apply(request, recommended)), measured, startup, traffic),
    ]
    for row in table:
        if row.max_model_len != startup.max_model_len:
            s = predict(replace(startup.request, max_model_len=row.max_model_len))
            effects.append(effect(f"max_model_len {row.max_model_len:,}", s, measured, startup, traffic))
    return LiveAdvice(measured, startup, serving_failure(startup), advised, recommended, traffic, table, effects)
