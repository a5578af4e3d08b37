"""``kvgate advise``: vLLM's start-up predicted before a GPU is booked, and flags that start and serve.

``kvgate advise --model FOLDER --gpu NAME|BYTES [vLLM's flags] [--vllm-version V] [--json]``
prints what the release would log (weights, profile peak, non-torch memory, CUDA graphs, the KV
pool and the "Maximum concurrency" line), where it would die or refuse, and the proposed flags.
The prediction is kvgate/advise_startup.py, the proposals kvgate/advise_flags.py.
``kvgate advise --from URL`` advises a running kvgate's deployment from the traffic it measured
(kvgate/advise_live.py), and `advice_document` is what its ``GET /advice`` answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from types import ModuleType
from typing import Any

import httpx

from kvgate.advise_flags import Recommendation, gib, recommend, serving_failure
from kvgate.advise_live import LiveAdvice, advise_from, request_from_json, request_json
from kvgate.advise_startup import COMPILED_FORWARD_FACTOR, Failure, Request, Startup, predict
from kvgate.advise_traffic import Distribution, LengthRow, Traffic, capacity_table, parse_traffic, read_page
from kvgate.gpus import GPUS
from kvgate.memory.vllm_runner import NEWEST_KNOWN
from kvgate.model_folder import ModelFolderError, resolve_model_folder
from kvgate.telemetry.gpu import nvml_probe
from kvgate.traffic_record import Measured
from kvgate.vllm_flags import add_vllm_arguments, size_argument

# vLLM's flags that change the start-up (declared once in kvgate.vllm_flags).
STARTUP_FLAGS = (
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "dtype",
    "kv_cache_dtype",
    "block_size",
    "enforce_eager",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
    "speculative_config",
    "model_runner",
    "sampler",
)
# Where vLLM picks by release or GPU, advise does too: unset means vLLM's default.
RELEASE_DEFAULTS: dict[str, Any] = {
    "max_num_batched_tokens": None,
    "max_num_seqs": None,
    "gpu_memory_utilization": None,
    "block_size": None,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-config",
        "--model",
        dest="model_config",
        metavar="DIR",
        help="folder holding the model's config.json, a Hugging Face hub cache entry, or a model id "
        "already in the local hub cache (also vLLM's --model or MODEL)",
    )
    parser.add_argument(
        "--gpu",
        help=f"the GPU: one of {', '.join(sorted(GPUS))}, or its total memory as CUDA reports it (79.25GiB); "
        "required unless --from gives it",
    )
    add_vllm_arguments(parser, STARTUP_FLAGS, typed=True, defaults=RELEASE_DEFAULTS)
    parser.add_argument(
        "--vllm-version",
        default=NEWEST_KNOWN,
        help=f"the vLLM release to predict [default: {NEWEST_KNOWN}, the newest kvgate read]",
    )
    parser.add_argument(
        "--cuda-context-bytes",
        type=size_argument,
        default=None,
        help="the CUDA context of vLLM's process (default: kvgate's 500 MiB; nvidia-smi shows yours)",
    )
    parser.add_argument(
        "--other-processes-bytes",
        type=size_argument,
        default=None,
        help="GPU memory other processes hold; advised flags leave it free (default: what NVML shows "
        "used on the GPUs NVIDIA_VISIBLE_DEVICES names, all of it others' before vLLM starts; 0 without NVML)",
    )
    parser.add_argument(
        "--request-tokens",
        type=int,
        default=None,
        help="the prompt + max_tokens of your traffic's requests: sizes the --max-num-seqs advice",
    )
    parser.add_argument(
        "--traffic-metrics",
        metavar="URL|FILE",
        default=None,
        help="vLLM's /metrics page (a URL or a saved file): its request histograms give the "
        "traffic's prompt and max_tokens percentiles, --request-tokens (P99 + P99) and a table of "
        "--max-model-len against them",
    )
    parser.add_argument(
        "--from",
        dest="from_url",
        metavar="URL",
        default=None,
        help="a running kvgate (http://host:port, or its /advice): advise from the deployment it guards and "
        "the traffic it measured; --model and --gpu, when given, replace the ones it reports",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def request_from(args: argparse.Namespace) -> Request:
    """The prediction's input from the command line (ModelFolderError: no model folder)."""
    folder = resolve_model_folder(args.model_config)  # a folder, a hub cache entry or a cached model id
    spec = args.speculative_config
    extra = {} if args.cuda_context_bytes is None else {"cuda_context_bytes": args.cuda_context_bytes}
    return Request(
        model=str(folder),
        gpu=args.gpu,
        vllm_version=args.vllm_version,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        cudagraph_capture_sizes=tuple(args.cudagraph_capture_sizes) if args.cudagraph_capture_sizes else None,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        model_runner=args.model_runner,
        sampler=args.sampler,
        speculative_method=spec.method if spec else None,
        speculative_model=spec.model if spec else None,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        **extra,
    )


def run(args: argparse.Namespace) -> int:
    """Print the prediction and the advice; 0 if vLLM starts, 1 if it dies or refuses, 2 on bad input."""
    if args.from_url:
        return run_from(args)
    if not args.gpu:
        print("kvgate advise: --gpu is required (or --from a running kvgate)", file=sys.stderr)
        return 2
    try:
        traffic = parse_traffic(read_page(args.traffic_metrics)) if args.traffic_metrics else None
        startup = predict(request_from(args))
        request_tokens = args.request_tokens or (traffic.typical_request_tokens if traffic else None)
        others = co_tenant_bytes() if args.other_processes_bytes is None else args.other_processes_bytes
        advised, recommended = recommend(startup, request_tokens, others)
        table = capacity_table(startup, traffic) if traffic else None
    except (ValueError, KeyError, ModelFolderError, OSError, httpx.HTTPError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) else exc
        print(f"kvgate advise: {message}", file=sys.stderr)
        return 2
    serving = serving_failure(startup)
    if args.json:
        doc = as_json(startup, serving, advised, recommended)
        if traffic is not None and table is not None:
            doc["traffic"] = traffic_json(traffic, table)
        print(json.dumps(doc, indent=2))
    else:
        lines = as_text(startup, serving, advised, recommended)
        if traffic is not None and table is not None:
            lines += traffic_text(traffic, table)
        print("\n".join(lines))
    return 0 if startup.fits else 1


def co_tenant_bytes(nvml: ModuleType | None = None) -> int:
    """What other processes hold on the GPUs vLLM will use, read through NVML before it starts
    (all of the used memory is theirs then): the most on any visible GPU, since vLLM's budget is
    per GPU. 0 where NVML cannot be read (no GPU here, or no driver in this container)."""
    probe = nvml_probe(nvml=nvml)
    if not probe.available:
        return 0
    reading = asyncio.run(probe.read())
    return max((device.used for device in reading.devices), default=0)


def advice_url(url: str) -> str:
    return url if url.rstrip("/").endswith("/advice") else url.rstrip("/") + "/advice"


def run_from(args: argparse.Namespace) -> int:
    """`--from URL`: the running kvgate's deployment and measured traffic, advised here."""
    try:
        response = httpx.get(advice_url(args.from_url), timeout=30)
        response.raise_for_status()
        doc = response.json()
        model = str(resolve_model_folder(args.model_config)) if args.model_config else None
        if not (args.gpu or doc["deployment"]["gpu"]):
            raise ValueError(doc.get("problem") or "the page names no GPU: pass --gpu")
        request = request_from_json(doc["deployment"], model=model, gpu=args.gpu)
        advice = advise_from(request, Measured.from_json(doc["measured"]), args.other_processes_bytes or 0)
    except (ValueError, KeyError, TypeError, ModelFolderError, OSError, httpx.HTTPError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"kvgate advise: {message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(advice_document(advice), indent=2))
    else:
        print("\n".join(live_text(advice)))
    return 0 if advice.startup.fits else 1


def advice_document(advice: LiveAdvice) -> dict[str, Any]:
    """What `GET /advice` answers and `kvgate advise --from URL --json` prints: the deployment as
    advise's input, what kvgate measured, and the advice."""
    doc = as_json(advice.startup, advice.serving, advice.advised, advice.recommended)
    doc["traffic"] = traffic_json(advice.traffic, advice.table)
    doc["effects"] = [
        {
            "configuration": e.label,
            "max_model_len": e.max_model_len,
            "starts": e.starts,
            "kv_pool_blocks": e.pool_blocks,
            "refused_too_long_share": list(e.refused_too_long),
            "kv_waits": e.kv_waits,
            "kv_waits_avoided": e.kv_waits_avoided,
            "never_fits": e.never_fits,
            "never_fits_served": e.never_fits_served,
            "transient_waits": e.transient_waits,
            "transient_headroom_change_bytes": e.transient_headroom_change,
            "summary": e.sentence(advice.measured),
        }
        for e in advice.effects
    ]
    return {"deployment": request_json(advice.startup.request), "measured": advice.measured.to_json(), "advice": doc}


def live_text(advice: LiveAdvice) -> list[str]:
    m = advice.measured
    lines = as_text(advice.startup, advice.serving, advice.advised, advice.recommended)
    lines += traffic_text(advice.traffic, advice.table, f"kvgate's record, {m.seconds:,.0f} s", "kvgate's buckets")
    for route, counts in m.routes.items():
        lines.append(
            f"  {route}: {counts['requests']:,} requests, n > 1 in {counts['n_above_one']:,}, logprobs in "
            f"{counts['logprobs']:,}, prompt logprobs in {counts['prompt_logprobs']:,}; prompt P99 <= "
            f"{m.prompt[route].quantile(0.99):,.0f}, output P99 <= {m.output[route].quantile(0.99):,.0f}"
        )
    share = m.prefix_blocks_in_flight / m.prefix_blocks if m.prefix_blocks else 0.0
    lines.append(
        f"  prefix reuse: {100 * share:.1f}% of {m.prefix_blocks:,} full prompt blocks were held by a request in flight"
    )
    if m.refusals:
        lines.append("  refused: " + ", ".join(f"{reason} {n:,}" for reason, n in sorted(m.refusals.items())))
    for reason, waits in sorted(m.queue_waits.items()):
        s = waits.summary()
        lines.append(
            f"  queued for {reason}: {s['count']:,}, wait P50 <= {s['p50_at_most']:.3g} s, P99 <= {s['p99_at_most']:.3g} s"
        )
    budget = f" (transient budget then {gib(m.transient_budget_at_peak)})" if m.transient_budget_at_peak else ""
    lines.append(f"  largest transient reservation {gib(m.peak_transient_bytes)}{budget}")
    lines.append("what each configuration would have done (kvgate's arithmetic, not a replay)")
    lines += [f"  {e.sentence(m)}" for e in advice.effects]
    return lines


def traffic_json(traffic: Traffic, table: list[LengthRow]) -> dict[str, Any]:
    return {
        "prompt_tokens": traffic.prompt.summary(),
        "max_tokens": traffic.max_tokens.summary(),
        "generation_tokens": traffic.generation.summary(),
        "request_tokens": traffic.request_tokens,
        "capacity_table": [
            {
                "max_model_len": row.max_model_len,
                "fits": row.fits,
                "max_concurrency": row.max_concurrency,
                "p99_requests_held": row.p99_requests,
                "prompts_longer_share": list(row.prompts_longer),
            }
            for row in table
        ],
    }


def traffic_text(
    traffic: Traffic, table: list[LengthRow], source: str = "vLLM's /metrics", buckets: str = "vLLM's histogram buckets"
) -> list[str]:
    def dist(name: str, d: Distribution) -> str:
        s = d.summary()
        return (
            f"  {name}: {s['count']:,} requests, P50 <= {s['p50_at_most']}, P95 <= {s['p95_at_most']}, "
            f"P99 <= {s['p99_at_most']}, max <= {s['max_at_most']} ({buckets})"
        )

    lines = [
        f"traffic ({source})",
        dist("prompt tokens", traffic.prompt),
        dist("max_tokens", traffic.max_tokens),
        dist("generated tokens", traffic.generation),
        f"  a P99 request: {traffic.request_tokens} tokens "
        + ("(P99 of prompt + max_tokens)" if traffic.requests is not None else "(P99 prompt + P99 max_tokens)"),
        "  max_model_len: starts, maximum concurrency, P99 requests the pool holds, past prompts longer",
    ]
    for row in table:
        low, high = row.prompts_longer
        longer = f"{100 * low:.1f}%" if low == high else f"{100 * low:.1f}-{100 * high:.1f}%"
        lines.append(
            f"  {row.max_model_len:>9,}: {'starts' if row.fits else 'fails '}, {row.max_concurrency:.2f}x, "
            f"{row.p99_requests if row.p99_requests is not None else '-'}, {longer}"
        )
    return lines


def _failure_json(failure: Failure | None) -> dict[str, Any] | None:
    if failure is None:
        return None
    return {
        "step": failure.step,
        "bytes": failure.bytes,
        "flag": failure.flag,
        "kind": failure.kind,
        "message": failure.message,
    }


def startup_json(s: Startup) -> dict[str, Any]:
    """The prediction in numbers (bytes per GPU)."""
    pool = s.sized_the_pool
    return {
        "vllm_version": s.release.version,
        "engine": s.release.engine,
        "runner": s.runtime.runner,
        "sampler": s.runtime.sampler_backend,
        "gpu_total_bytes": s.gpu_total,
        "gpu_memory_utilization": s.utilization,
        "requested_bytes": s.requested,
        "outside_budget_bytes": s.outside,
        "max_model_len": s.max_model_len,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "max_num_seqs": s.max_num_seqs,
        "weights_bytes": s.weights,
        "runner_state_bytes": s.runner_state,
        "profile_peak_bytes": s.profile_peak,
        "profile_forward_bytes": s.profile_forward,
        "profile_sampler_bytes": s.profile_sampler,
        "full_step_bytes": s.full_step,
        "non_torch_bytes": s.non_torch,
        "cuda_graph_bytes": s.graphs,
        "cuda_graph_sizes": s.graph_sizes,
        "cuda_graphs_in_budget": s.release.graphs_in_budget,
        # null where vLLM dies before sizing the pool
        "kv_cache_bytes": s.kv_cache_bytes if pool else None,
        "kv_cache_blocks": s.capacity.num_blocks if pool else None,
        "block_size": s.block_size,
        "kv_cache_tokens": s.capacity.kv_cache_tokens if pool else None,
        "max_concurrency": round(s.capacity.max_concurrency, 2) if pool else None,
        "fits": s.fits,
        "failure": _failure_json(s.failure),
        "estimated_max_model_len": s.estimated_max_model_len,
        "warnings": list(s.warnings),
    }


def as_json(
    startup: Startup, serving: Failure | None, advised: Startup, recommended: list[Recommendation]
) -> dict[str, Any]:
    return {
        "startup": startup_json(startup),
        "serving": {"safe": serving is None and startup.fits, "failure": _failure_json(serving)},
        "recommended": [{"flag": r.flag, "value": r.value, "reason": r.reason} for r in recommended],
        "advised_startup": startup_json(advised),
    }


def as_text(
    startup: Startup, serving: Failure | None, advised: Startup, recommended: list[Recommendation]
) -> list[str]:
    s = startup
    graphs_where = "inside the budget" if s.release.graphs_in_budget else "on top, after the pool"
    lines = [
        f"vLLM {s.release.version} ({s.release.engine.upper()} engine, model runner {s.runtime.runner.upper()}, "
        f"{s.runtime.sampler_backend} sampler) on {gib(s.gpu_total)}, gpu_memory_utilization {s.utilization} "
        f"({gib(s.requested)}); outside the budget {gib(s.outside)}",
        f"  max_model_len {s.max_model_len:,}, max_num_batched_tokens {s.max_num_batched_tokens:,}, "
        f"max_num_seqs {s.max_num_seqs:,}",
        f"  Model loading took {gib(s.weights)}"
        + (f"; Model Runner V2's penalty state {gib(s.runner_state)}" if s.runner_state else ""),
        f"  profile peak {gib(s.profile_peak)} (forward {gib(s.profile_forward)}, sampler {gib(s.profile_sampler)})"
        f"; non-torch {gib(s.non_torch)}",
        f"  CUDA graphs {gib(s.graphs)} ({s.graph_sizes} sizes, {graphs_where})",
    ]
    if s.release.compiled:
        lines.append(
            f"  compiled forward, for the out-of-memory check: {gib(int(s.profile_forward * COMPILED_FORWARD_FACTOR))} "
            f"(torch.compile's buffers, {COMPILED_FORWARD_FACTOR} x the eager tape: docs/advise.md)"
        )
    reached_pool = s.sized_the_pool
    if reached_pool and s.request.kv_cache_memory_bytes is None:
        lines.append(f"  Available KV cache memory: {gib(s.kv_cache_bytes)}")
    elif reached_pool:
        lines.append(f"  KV cache memory (--kv-cache-memory-bytes, not measured): {gib(s.kv_cache_bytes)}")
    if s.failure is None or s.failure.flag == "--max-model-len":
        lines += [
            f"  GPU KV cache size: {s.capacity.kv_cache_tokens:,} tokens ({s.capacity.num_blocks:,} blocks of {s.block_size})",
            f"  Maximum concurrency for {s.max_model_len:,} tokens per request: {s.capacity.max_concurrency:.2f}x",
        ]
    lines += [f"  warning: {w}" for w in s.warnings]
    if s.failure is None:
        lines.append("start-up: fits")
    else:
        f = s.failure
        lines.append(f"start-up: {f.kind} in {f.step} ({gib(f.bytes)}; change {f.flag})")
        lines.append(f"  {f.message}")
    if serving is not None:
        lines.append(f"serving: dies at the {serving.step} ({gib(serving.bytes)}; change {serving.flag})")
        lines.append(f"  {serving.message}")
    still = f" (kvgate found none that start: {advised.failure.step})" if advised.failure else ""
    lines.append("advised flags" + still)
    for r in recommended:
        lines.append(f"  {r.flag} {r.value}: {r.reason}")
    if advised.request != startup.request and advised.fits:
        lines.append(
            f"  with them: KV cache {gib(advised.kv_cache_bytes)}, {advised.capacity.kv_cache_tokens:,} tokens, "
            f"maximum concurrency {advised.capacity.max_concurrency:.2f}x at {advised.max_model_len:,} tokens"
        )
    return lines
