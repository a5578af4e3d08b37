"""Every knob of `kvgate serve` in one place: flags, `KVGATE_*` environment variables, defaults.

vLLM's memory-relevant settings keep vLLM's own flag names and defaults so an operator can copy
them from the vLLM command line. Values the backend reveals in `vllm:cache_config_info` win over
these at start-up (see `kvgate.engine_config.resolve`).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvgate.memory.envelope import CUDA_CONTEXT_BYTES
from kvgate.units import KiB, MiB
from kvgate.vllm_flags import ByteSize, OptionalByteSize, VllmFlags, add_vllm_arguments

GpuProbeMode = Literal["auto", "nvml", "sim", "none"]
MetricsPage = Literal["kvgate", "vllm"]


class Settings(BaseSettings, VllmFlags):
    """kvgate's configuration; flags beat environment variables, which beat defaults. vLLM's own
    flags (names, defaults) come from kvgate.vllm_flags, shared with capacity and sim. Every byte
    count takes vLLM's units (100MiB, 1G, 25.6k: kvgate.units.parse_size)."""

    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="forbid")

    backend: str = Field("http://127.0.0.1:8000", description="Base URL of the vLLM server.")
    model: str | None = Field(None, description="Model folder (config.json and tokenizer), the one vLLM serves.")
    served_model_name: str | None = Field(
        None, description="Model name clients send; default: read from the backend's /v1/models."
    )
    listen: str = Field("0.0.0.0:8080", description="Address kvgate listens on, HOST:PORT.")

    num_gpu_blocks: int | None = Field(
        None, description="KV pool size in blocks when the backend's /metrics does not say."
    )
    gpu_memory_bytes: OptionalByteSize = Field(
        None, description="Total memory of one GPU (80GiB, 85899345920), for the static transient budget."
    )
    free_memory_bytes: OptionalByteSize = Field(
        None,
        description="GPU memory left outside vLLM's pools for transient tensors the profile never "
        "saw; default: gpu-memory-bytes x (1 - gpu-memory-utilization) less the CUDA context and, "
        "at TP > 1, the communicators' buffers (both outside vLLM's utilization envelope).",
    )
    cuda_context_bytes: ByteSize = Field(
        CUDA_CONTEXT_BYTES,
        ge=0,
        description="Device memory of vLLM's CUDA context, held outside gpu-memory-utilization "
        "(vLLM takes its memory snapshot after creating it); not readable from vLLM's code: "
        "500 MiB, above PyTorch's ~300 MB figure (pytorch/pytorch#107667).",
    )
    profiled_activation_bytes: OptionalByteSize = Field(
        None,
        description="Activation peak of vLLM's start-up profile (its log line); default: kvgate's "
        "estimate from the model geometry.",
    )
    expandable_segments: bool = Field(
        False,
        description="vLLM runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (its environment, "
        "which kvgate cannot read): freed memory does not strand in the caching allocator's segments, so "
        "the profiled terms are charged their page-rounded bytes, not the segment overhead.",
    )
    transient_safety_margin: float = Field(
        0.1, ge=0.0, lt=1.0, description="Fraction of the transient headroom kept unspent."
    )
    default_max_tokens: int | None = Field(
        None,
        description="Output tokens reserved when a request has no max_tokens; default: what vLLM "
        "allows, max-model-len minus the prompt.",
    )

    scrape_interval: float = Field(
        0.25,
        gt=0,
        description="Seconds between scrapes of vLLM's /metrics and GPU readings while requests are queued, "
        "in flight or in vLLM.",
    )
    idle_scrape_interval: float = Field(
        1.0,
        gt=0,
        description="Seconds between those scrapes while nothing is (the next request wakes the loop at "
        "once); at most half of --max-staleness, so an idle budget stays live, and never less than "
        "--scrape-interval.",
    )
    metrics_page: MetricsPage = Field(
        "kvgate",
        description="What GET /metrics serves: kvgate (vLLM's routing gauges with kvgate's queue and "
        "reservations in them, vLLM's cache_config_info and lora_requests_info, then kvgate's own "
        "families) or vllm (vLLM's page unmodified, fetched per scrape; kvgate's families stay on "
        "/kvgate/metrics).",
    )
    metrics_cache_seconds: float = Field(
        1.0,
        ge=0,
        description="kvgate's own families on /metrics are rendered at most this often (a router scrapes "
        "every 50 ms); the vLLM gauges are computed on every scrape. 0: render every scrape.",
    )
    max_staleness: float = Field(
        2.0,
        gt=0,
        description="Readings older than this put the budget in conservative mode (see "
        "--stale-budget-fraction); never admit blind at full speed.",
    )
    stale_budget_fraction: float = Field(
        0.5,
        gt=0,
        le=1.0,
        description="Share of the transient limit kvgate may reserve while its readings are stale; the "
        "KV limit is the pool, overcommit off (a full pool makes vLLM queue or preempt, never run out "
        "of memory).",
    )
    gpu_probe: GpuProbeMode = Field(
        "auto",
        description="GPU memory readings: nvml (nvidia-ml-py), sim (the simulator's /sim/gpu), none; "
        "auto: sim if the backend has /sim/gpu, else nvml if a GPU is visible, else none.",
    )
    gpu_devices: str | None = Field(
        None,
        description="GPUs the backend runs on, as NVIDIA_VISIBLE_DEVICES names them (UUIDs, MIG- "
        "UUIDs or indices, comma-separated); default: NVIDIA_VISIBLE_DEVICES, else all.",
    )
    max_kv_overcommit: float = Field(
        1.2,
        ge=1.0,
        description="Upper bound of the calibrated KV overcommit factor: while requests wait for "
        "KV, kvgate may reserve up to this many times vLLM's pool, backing off when vLLM preempts "
        "(a preemption costs latency, never an OOM); 1 never reserves more than the pool.",
    )
    kv_output_quantile: float = Field(
        0.99,
        gt=0.0,
        le=1.0,
        description="Each request reserves KV for the mean of recent output lengths (an answer "
        "that used its whole max_tokens counts as needing all of the new request's; full "
        "max_tokens until 16 have finished), and the pool keeps room for this normal quantile of "
        "the in-flight outputs' summed spread; 1: always reserve max_tokens. A request that "
        "outgrows its reservation can be preempted, never OOM.",
    )
    max_transient_safety_margin: float = Field(
        0.6, gt=0.0, lt=1.0, description="Upper bound of the calibrated transient safety margin."
    )

    max_queue: int = Field(1024, ge=0, description="Requests that may wait for admission.")
    max_queue_wait: float = Field(30.0, gt=0, description="Seconds a request may wait, at most.")
    tenant_header: str | None = Field(
        None,
        description="Header a trusted gateway in front of kvgate sets to name the tenant; unset: "
        "the tenant is a digest of the API key and no client header is read (a client naming its "
        "own tenant could take every turn).",
    )
    max_tenants: int = Field(
        256,
        ge=1,
        description="API keys (unchecked, no --tenant-header) that may hold queue turns of their own: "
        "a key's first request waits in one turn shared by all new keys, its later ones in its own; "
        "beyond this many, the least recently seen key is forgotten.",
    )
    max_body_bytes: ByteSize = Field(32 * MiB, gt=0, description="Largest request body accepted (413 beyond).")
    upstream_timeout: float = Field(600.0, gt=0, description="Seconds to wait for the backend's next byte.")
    log_level: str = Field("info", description="Python log level.")

    # Hostile clients (issue 15): what one request may cost kvgate.
    trust_request_chat_template: bool = Field(
        False,
        description="vLLM --trust-request-chat-template: accept a request's own chat_template "
        "(refused with 400 otherwise, as vLLM does); set it when vLLM has it. Rendered in a "
        "sandbox under --request-chat-template-timeout.",
    )
    request_chat_template_timeout: float = Field(
        1.0, gt=0, description="Seconds a request's own chat template may take to render (400 beyond)."
    )
    max_process_memory_bytes: OptionalByteSize = Field(
        None,
        gt=0,
        description="Memory kvgate may use (its container's limit); half of it bounds the requests being "
        "parsed, rendered and tokenized at once (429 when taken, 413 for a body that could never fit). "
        "Unset: the cgroup's limit, else 2 GiB (the manifests' limit).",
    )
    preparation_workers: int = Field(
        2,
        ge=1,
        description="Worker processes that parse, render and tokenize large bodies and every request's own "
        "chat template, off the event loop, each stopped when it passes its memory or time budget.",
    )
    priority_header: str | None = Field(
        None,
        description="Header a trusted gateway sets to give a request's queue priority (an integer, "
        "lower first); unset: no header is read.",
    )
    max_header_bytes: ByteSize = Field(
        64 * KiB, gt=0, description="Largest request head (request line and headers) accepted (431 beyond)."
    )
    max_headers: int = Field(100, gt=0, description="Most headers a request may carry (431 beyond).")
    client_header_timeout: float = Field(
        10.0, gt=0, description="Seconds a client may take to send a request head (408 beyond)."
    )
    client_body_timeout: float = Field(
        30.0, gt=0, description="Seconds a client may leave between two parts of a request body (408 beyond)."
    )
    client_body_deadline: float = Field(
        60.0,
        gt=0,
        description="Seconds a client may take to send a whole request body, from its head on (408 and the "
        "connection closed beyond); 60 s lets a 32 MiB body arrive at 0.6 MB/s.",
    )
    stream_stall_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds a client may leave its socket buffer full without reading the answer; "
        "beyond, kvgate cuts the stream, aborts the backend request and releases its reservation "
        "(vLLM itself waits forever, generating to max_tokens meanwhile).",
    )
    upstream_connect_timeout: float = Field(
        5.0, gt=0, description="Seconds to wait for the backend to accept a connection (503 beyond)."
    )
    upstream_pool_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a request may wait for one of kvgate's 1,024 backend connections (503 beyond).",
    )
    tokenize_connections: int = Field(
        256,
        ge=1,
        description="Concurrent calls to the backend's /tokenize when the model folder has no tokenizer "
        "files (vLLM answers them in its API server, not the engine); a request that finds them all busy "
        "waits for one until its --max-queue-wait deadline (429 queue_timeout beyond).",
    )
    passthrough_paths: str = Field(
        "/v1/models, /health, /ping, /version, /load, /tokenize, /detokenize, /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter",
        description="Paths forwarded to vLLM without gating (under the body limits and timeouts of every "
        "route, with a reverse proxy's headers), comma-separated, matched exactly; any other "
        "path but the gated ones (completions, chat, /invocations, /v1/responses, /v1/messages, "
        "/inference/v1/generate and the pooling routes: docs/routes.md) gets 404, vLLM's admin "
        "routes (/sleep, /pause, /collective_rpc, ...) included unless named here. A 200 from "
        "/v1/load_lora_adapter or /v1/unload_lora_adapter (vLLM serves them with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING) makes kvgate re-read /v1/models.",
    )
    trust_request_priority: bool = Field(
        False,
        description="Order kvgate's queue by the body's `priority` field; off: every request has "
        "priority 0 in kvgate's queue (the field still reaches vLLM), so no client can jump the line.",
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_settings_arguments(parser: argparse.ArgumentParser, only: Collection[str] | None = None) -> None:
    """One flag per Settings field (or per field in `only`), defaulting to 'unset' so environment
    variables still apply; vLLM's own flags come from their one declaration (kvgate.vllm_flags)."""
    vllm_names = [n for n in VllmFlags.model_fields if only is None or n in only]
    add_vllm_arguments(parser, vllm_names, env_prefix="KVGATE_")
    for name, field in Settings.model_fields.items():
        if name in VllmFlags.model_fields or (only is not None and name not in only):
            continue
        default = field.default
        help_text = f"{field.description} [env KVGATE_{name.upper()}; default: {default}]"
        if field.annotation is bool:
            parser.add_argument(
                _flag(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            choices = getattr(field.annotation, "__args__", None) if name in ("gpu_probe", "metrics_page") else None
            parser.add_argument(
                _flag(name),
                dest=name,
                default=argparse.SUPPRESS,
                help=help_text,
                choices=choices,
            )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed flags; pydantic validates and converts the strings.

    A bad value exits with pydantic's message naming the field, not a traceback.
    """
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    try:
        return Settings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}" for e in exc.errors()
        )
        raise SystemExit(f"kvgate: invalid configuration: {problems}") from None
