"""`kvgate sim`: serve a simulated vLLM. vLLM's flags keep vLLM's names and defaults."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from app.sim.config import CoTenant, SimConfig
from app.sim.startup import StartupError
from app.vllm_flags import add_vllm_arguments

# vLLM's flags the simulator plays, declared once in app.vllm_flags.
SIM_VLLM_FLAGS = (
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "block_size",
    "enable_prefix_caching",
    "long_prefill_token_threshold",
    "tensor_parallel_size",
    "kv_cache_dtype",
    "enforce_eager",
    "num_gpu_blocks_override",
    "dtype",
    "max_logprobs",
)

if TYPE_CHECKING:
    from app.sim.engine import Engine


def _cotenant(spec: str) -> CoTenant:
    """NAME:BYTES[:START_S[:END_S]] in simulated seconds."""
    parts = spec.split(":")
    end = float(parts[3]) if len(parts) > 3 else None
    return CoTenant(parts[0], int(float(parts[1])), float(parts[2]) if len(parts) > 2 else 0.0, end)


def _json_object(text: str) -> dict[str, Any]:
    """--speculative-config: a JSON object, as vLLM takes it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.1-8b", help="model preset or config.json folder")
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset or total bytes ('80GiB')")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_vllm_arguments(p, SIM_VLLM_FLAGS, typed=True)
    # The simulator picks these as vLLM does (by GPU size, by model) when they are not given.
    p.set_defaults(max_num_batched_tokens=None, max_num_seqs=None, block_size=None)
    p.add_argument(
        "--attention-backend", default="auto", choices=["auto", "flash-attn", "flashinfer", "mla", "materializing"]
    )
    p.add_argument(
        "--cudagraph-memory-in-budget",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM >= 0.21 behaviour (off: graphs on top of the budget)",
    )
    p.add_argument(
        "--expandable-segments", action="store_true", help="as PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    p.add_argument(
        "--non-torch-bytes",
        type=int,
        default=None,
        help="measured 'non-torch forward increase memory' (inside the budget)",
    )
    p.add_argument(
        "--cuda-context-bytes",
        type=int,
        default=None,
        help="device memory held before the profile (outside the budget, vLLM >= 0.7)",
    )
    p.add_argument("--vllm-version", default="0.32.0", help="the vLLM release to play")
    p.add_argument(
        "--model-runner",
        choices=["auto", "v1", "v2"],
        default="auto",
        help="auto: the runner that release picks for the model by its own rule",
    )
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    p.add_argument("--cotenant", action="append", type=_cotenant, default=[], metavar="NAME:BYTES[:START[:END]]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speedup", type=float, default=1.0, help="simulated seconds per second")
    p.add_argument("--restart-seconds", type=float, default=60.0)
    p.add_argument(
        "--metrics-clock",
        choices=["wall", "sim"],
        default="wall",
        help="seconds of the latency histograms: wall clock, or simulated (step) time",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    names = set(SimConfig.__dataclass_fields__)
    kw = {k: v for k, v in vars(args).items() if k in names and k != "cotenants"}
    return SimConfig(**kw, cotenants=list(args.cotenant))


def run(args: argparse.Namespace, announce: Callable[[Engine], None] | None = None) -> int:
    """Serve until stopped; `announce` sees the started engine before the port opens."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from app.sim.server import create_sim_app

    try:
        app = create_sim_app(config_from_args(args))
    except StartupError:
        return 1  # the engine has logged vLLM's message
    except (KeyError, ValueError) as exc:  # unknown preset, unreadable config.json
        logging.getLogger("kvgate.sim").error("%s", exc)
        return 2
    if announce is not None:
        announce(app.state.engine)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
