"""`kvgate sim`: serve a simulated vLLM. vLLM's flags keep vLLM's names and defaults."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn

from kvgate.sim.config import CoTenant, SimConfig
from kvgate.sim.startup import StartupError
from kvgate.vllm_flags import SpeculativeConfig, add_vllm_arguments, size_argument

# vLLM's flags the simulator plays: names, aliases, parsers and help are their one declaration in
# kvgate.vllm_flags (shared with serve, explain and capacity); only some defaults are the simulator's.
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
    "attention_backend",
    "vllm_version",
    "model_runner",
    "speculative_config",
    "sampler",
)
# The simulator plays one vLLM release (kvgate asks the backend which), and picks batch sizes and
# the block size as vLLM does (by GPU size, by model) when they are not given.
SIM_DEFAULTS = {
    "vllm_version": "0.32.0",
    "max_num_batched_tokens": None,
    "max_num_seqs": None,
    "block_size": None,
}

if TYPE_CHECKING:
    from kvgate.sim.engine import Engine


def _cotenant(spec: str) -> CoTenant:
    """NAME:BYTES[:START_S[:END_S]] in simulated seconds."""
    parts = spec.split(":")
    end = float(parts[3]) if len(parts) > 3 else None
    return CoTenant(parts[0], size_argument(parts[1]), float(parts[2]) if len(parts) > 2 else 0.0, end)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.1-8b", help="model preset or config.json folder")
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset or total bytes ('80GiB', '80G')")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_vllm_arguments(p, SIM_VLLM_FLAGS, typed=True, defaults=SIM_DEFAULTS)
    p.add_argument(
        "--cudagraph-memory-in-budget",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA graphs inside the KV budget (default: as --vllm-version does; off: on top of it)",
    )
    p.add_argument(
        "--expandable-segments", action="store_true", help="as PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    p.add_argument(
        "--non-torch-bytes",
        type=size_argument,
        default=None,
        help="measured 'non-torch forward increase memory' (inside the budget)",
    )
    p.add_argument(
        "--cuda-context-bytes",
        type=size_argument,
        default=None,
        help="device memory held before the profile (outside the budget, vLLM >= 0.7)",
    )
    for name, what in (
        ("reqs", "unfinished requests (one per sequence)"),
        ("tokens", "prompt tokens still prefilling"),
    ):
        p.add_argument(
            f"--max-num-queued-{name}",
            type=int,
            default=None,
            help=f"vLLM 0.32.0's API-server admission: 503 past this many {what} (default: no limit)",
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
    spec: SpeculativeConfig | None = args.speculative_config
    # the fields as given: the simulator checks them as vLLM does (no kvgate default filled in)
    kw["speculative_config"] = spec.model_dump(exclude_unset=True) if spec else None
    return SimConfig(**kw, cotenants=list(args.cotenant))


def run(args: argparse.Namespace, announce: Callable[[Engine], None] | None = None) -> int:
    """Serve until stopped; `announce` sees the started engine before the port opens."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from kvgate.sim.server import create_sim_app

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
