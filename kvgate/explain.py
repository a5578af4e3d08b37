"""What kvgate would do with a request right now, and why, without sending it."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvgate.composition import Runtime
from kvgate.errors import ContextTooLong, KvgateError
from kvgate.gate.budget import Budget
from kvgate.openai import parse_json_object
from kvgate.vllm_routes import ROUTE_PATHS, Route

ROUTES: frozenset[str] = frozenset(ROUTE_PATHS.values())


def endpoint_for(body: dict[str, Any], hint: str | None) -> Route:
    """The route named by `hint` (completions, chat, responses, messages, ...), else chat or
    completions by the body's shape."""
    if hint in ROUTES:
        return hint  # type: ignore[return-value]
    return "chat" if "messages" in body else "completions"


async def explain(rt: Runtime, raw: bytes, hint: str | None = None) -> dict[str, Any]:
    """The footprint, each transient term, the budget and the decision that would be taken now."""
    endpoint = endpoint_for(parse_json_object(raw), hint)
    try:
        evaluation = await rt.pipeline.predict(endpoint, raw)
    except ContextTooLong as error:
        return {"endpoint": endpoint, "decision": "reject", "reason": error.code, "message": error.message}
    prediction, demand, predictor = evaluation.prediction, evaluation.prediction.demand, evaluation.predictor
    budget = rt.budget
    unknown = unknown_limits(budget)
    preview = rt.gate_view.preview(demand, evaluation.request.priority)
    try:
        predictor.check_fits_ever(prediction, budget.ceiling())
        reason = preview.wait_reason
        if reason is not None:
            decision, message = "queue", reason
        elif unknown:
            decision, reason = "unknown", "budget_unknown"
            message = "fits what is known, but " + "; ".join(unknown)
        else:
            decision, reason, message = "admit", "fits", "fits now"
    except KvgateError as error:
        decision, reason, message = "reject", error.code, error.message
    return {
        "endpoint": endpoint,
        # The vLLM modelled: version, runner and sampler backend (kvgate/memory/vllm_runner.py).
        "vllm": rt.deployment.runtime.labels() if rt.deployment else None,
        "prompt_tokens": prediction.prompt_tokens,
        "max_new_tokens": prediction.max_new_tokens,
        "reserved_new_tokens": demand.reserved_tokens,
        "kv": {
            "blocks": demand.kv_blocks,
            "blocks_at_max_tokens": prediction.max_kv_blocks,
            "new_blocks": preview.new_kv_blocks,
            "shared_prefix_blocks": len(set(demand.shared_block_hashes)),
            "block_size": predictor.layout.block_size,
        },
        "transient": {
            "peak_bytes": prediction.transient_peak_bytes,
            "unprofiled_prefill_bytes": demand.transient_prefill_bytes,
            # what its prefill takes more once other requests share its steps (V2 prompt logprobs
            # run over the whole step): the ledger charges it for what the others in flight can
            # put in its steps; here at its most, full steps
            "beside_others_extra_bytes": demand.shared_step.bytes(None) if demand.shared_step else 0,
            "sampler_stage_with_in_flight": asdict(preview.sampler_stage),
            "profiled_bytes": demand.profiled_bytes,
            "terms": [asdict(term) for term in prediction.transient_terms],
        },
        "budget": {
            "kv_blocks_limit": budget.kv_limit(),
            "kv_blocks_reserved": preview.kv_blocks_reserved,
            "kv_margin_blocks_with_in_flight": preview.kv_margin_blocks,
            "transient_limit_bytes": budget.transient_limit(),
            "transient_reserved_bytes": preview.transient_reserved_bytes,
            "max_transient_limit_bytes": budget.max_transient_limit(),
            "profiled_peak_bytes": budget.profiled_peak_bytes,
            "queue_depth": preview.waiting,
        },
        "decision": decision,
        "reason": reason,
        "message": message,
    }


def unknown_limits(budget: Budget) -> list[str]:
    """What the budget cannot judge (offline, from flags alone): no limit means no verdict."""
    missing = []
    if budget.kv_limit() is None:
        missing.append("the KV pool size is unknown (give --num-gpu-blocks, or ask a running kvgate with --url)")
    if budget.transient_limit() is None:
        missing.append("the transient headroom is unknown (give --gpu-memory-bytes or --free-memory-bytes)")
    return missing
