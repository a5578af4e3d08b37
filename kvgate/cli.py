"""`kvgate serve | capacity | advise | explain | sim`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from kvgate import advise, capacity
from kvgate.logs import configure_logging, quiet_transformers_advice
from kvgate.model_folder import ModelFolderError, resolve_model_folder
from kvgate.settings import Settings, add_settings_arguments, settings_from_args
from kvgate.vllm_flags import (
    UnknownFlagError,
    VllmFlags,
    ignored_line,
    ignored_vllm_options,
    split_vllm_command,
)
from kvgate.vllm_routes import ROUTE_PATHS
from kvgate.work_budget import give_large_blocks_back

if TYPE_CHECKING:
    from kvgate.sim.engine import Engine


def parse_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"kvgate: --listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def with_model_folder(settings: Settings) -> Settings:
    """Settings whose --model is the local folder it names (a hub cache entry or model id
    resolved), or exit with one line saying what is wrong."""
    try:
        folder = resolve_model_folder(settings.model)
    except ModelFolderError as exc:
        raise SystemExit(f"kvgate: {exc}") from None
    return settings.model_copy(update={"model": str(folder)})


# glibc keeps at most 7 freed chunks of each size in a thread's cache; the Rust tokenizer allocates
# and frees a few hundred small ones per prompt, so most of them went through the arena's locked
# bins (malloc and free were a fifth of kvgate's CPU under load). With 256 they stay in the
# thread cache: about 15% less CPU per request, a few MiB more resident memory.
MALLOC_TUNABLE = "glibc.malloc.tcache_count=256"


def on_glibc() -> bool:
    """GLIBC_TUNABLES means something only to glibc (musl, e.g. in Alpine images, ignores it)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


def malloc_tuned_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment `kvgate serve` re-executes itself with, or None: not on glibc, or
    GLIBC_TUNABLES already sets a tcache count (the operator's choice is kept)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not on_glibc() or "glibc.malloc.tcache_count" in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{MALLOC_TUNABLE}" if tunables else MALLOC_TUNABLE}


def exec_with_malloc_tuning() -> None:
    """Replace this process (same pid, same command line) by one with the malloc tunable set:
    glibc reads it only at start-up. Does nothing if it is set already."""
    env = malloc_tuned_env(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def serve(args: argparse.Namespace) -> int:
    settings = with_model_folder(settings_from_args(args))
    host, port = parse_listen(settings.listen)
    configure_logging(settings.log_level)
    give_large_blocks_back()  # large request bodies leave kvgate's memory when freed

    import uvicorn

    from kvgate.http.limits import limited_http_protocol
    from kvgate.http.server import create_app

    try:
        app = create_app(settings)
    except ValueError as exc:  # a backend URL that is no URL
        raise SystemExit(f"kvgate: {exc}") from None
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=settings.log_level,
        log_config=None,
        access_log=False,
        timeout_keep_alive=30,
        http=limited_http_protocol(settings.max_header_bytes, settings.max_headers, settings.client_header_timeout),
        # The backend's own Date and Server headers pass through untouched; do not add ours.
        server_header=False,
        date_header=False,
        # The client's address is the socket's: kvgate.http.proxy appends it to X-Forwarded-For, and a
        # client's own X-Forwarded-For must not rewrite it.
        proxy_headers=False,
    )
    return 0


# The settings that change `kvgate explain`'s answer offline; the others (listening, scraping,
# queue and live calibration) mean something only to a running kvgate.
# explain's flags: every vLLM flag kvgate models (kvgate.vllm_flags) and kvgate's own that change
# the verdict.
EXPLAIN_SETTINGS = (
    *VllmFlags.model_fields,
    "backend",
    "model",
    "served_model_name",
    "num_gpu_blocks",
    "gpu_memory_bytes",
    "free_memory_bytes",
    "cuda_context_bytes",
    "profiled_activation_bytes",
    "transient_safety_margin",
    "expandable_segments",
    "default_max_tokens",
    "kv_output_quantile",
    "trust_request_chat_template",
)


def explain_command(args: argparse.Namespace) -> int:
    raw = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    if args.url:
        params = {"endpoint": args.endpoint} if args.endpoint else None
        response = httpx.post(args.url.rstrip("/") + "/kvgate/explain", content=raw, params=params, timeout=30)
        print(json.dumps(response.json(), indent=2))
        return 0 if response.status_code == 200 else 1
    from kvgate.tokens import has_local_tokenizer

    settings = with_model_folder(settings_from_args(args))
    if (
        not has_local_tokenizer(settings.model)
        and "backend" not in settings.model_fields_set
        and not _only_token_ids(raw)
    ):
        raise SystemExit(
            f"kvgate: the model folder {settings.model} has no tokenizer files; offline, kvgate "
            "calls no backend: give --backend URL to count tokens with vLLM's /tokenize, or --url "
            "to ask a running kvgate"
        )
    return asyncio.run(_explain_offline(settings, raw, args.endpoint))


def _only_token_ids(raw: bytes) -> bool:
    """A completions body whose prompts are all token ids: nothing to tokenize, no tokenizer needed."""
    try:
        prompt = json.loads(raw).get("prompt")
    except (ValueError, AttributeError):
        return False
    if not isinstance(prompt, list) or not prompt:
        return False
    prompts = prompt if all(isinstance(p, list) for p in prompt) else [prompt]
    return all(p and all(type(t) is int for t in p) for p in prompts)


async def _explain_offline(settings: Settings, raw: bytes, endpoint: str | None) -> int:
    from kvgate.composition import Runtime
    from kvgate.errors import KvgateError
    from kvgate.explain import explain
    from kvgate.http.errors import error_body

    runtime = Runtime(settings)
    try:
        runtime.configure_offline()
        print(json.dumps(await explain(runtime, raw, endpoint), indent=2))
        return 0
    except KvgateError as error:
        print(json.dumps(error_body(error), indent=2))
        return 1
    finally:
        await runtime.stop()


def sim_model_folder(args: argparse.Namespace) -> Path:
    """The folder `kvgate serve --model` needs in front of this simulator: the simulator's own
    folder, or a preset's config.json written out (no tokenizer files: kvgate then counts
    tokens through the simulator's /tokenize, which uses the simulator's stand-in tokenizer)."""
    from kvgate.sim.presets import write_model_folder

    if (Path(args.model) / "config.json").is_file():
        return Path(args.model).resolve()
    folder = args.model_folder or Path(tempfile.gettempdir()) / "kvgate-sim" / args.model
    return write_model_folder(args.model, folder).resolve()


def serve_command_for(engine: Engine, args: argparse.Namespace, folder: Path) -> list[str]:
    """The `kvgate serve` command line that matches a started simulator: its address, model
    folder, GPU size and the engine limits it resolved (vLLM's defaults applied)."""
    from kvgate.sim.presets import gpu_total_bytes

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    resolved = engine.resolved
    command = [
        "kvgate",
        "serve",
        "--backend",
        f"http://{host}:{args.port}",
        "--model",
        str(folder),
        "--listen",
        "127.0.0.1:8080",
        "--gpu-memory-bytes",
        str(gpu_total_bytes(args.gpu)),
        "--max-num-batched-tokens",
        str(resolved.max_num_batched_tokens),
        "--max-num-seqs",
        str(resolved.max_num_seqs),
    ]
    if args.served_model_name:
        command += ["--served-model-name", args.served_model_name]
    if args.attention_backend != "auto":
        command += ["--attention-backend", args.attention_backend]
    if args.tensor_parallel_size != 1:
        command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.long_prefill_token_threshold:
        command += ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
    return command


def sim_command(args: argparse.Namespace) -> int:
    """`kvgate sim`, telling the user how to put kvgate in front of it."""
    try:
        folder = sim_model_folder(args)
    except KeyError as exc:
        raise SystemExit(f"kvgate sim: {exc.args[0]}") from None

    def announce(engine: Engine) -> None:
        print(
            f"kvgate sim: model folder for kvgate: {folder}\n"
            f"put kvgate in front of this simulator with:\n"
            f"  {shlex.join(serve_command_for(engine, args, folder))}",
            flush=True,
        )

    from kvgate.sim import cli as sim_cli

    return sim_cli.run(args, announce)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """kvgate's command line; the simulator's own options are added only when `command` is
    "sim": reading them loads the simulator, which `kvgate serve` never needs."""
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser(
        "serve",
        help="Run the admission-control proxy in front of vLLM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_settings_arguments(serve_parser)
    serve_parser.set_defaults(run=serve)

    capacity_parser = commands.add_parser("capacity", help="KV cache capacity as vLLM computes it.")
    capacity.add_arguments(capacity_parser)
    capacity_parser.set_defaults(run=capacity.run)

    advise_parser = commands.add_parser(
        "advise",
        help="Predict vLLM's start-up on a GPU and propose flags that start and serve safely.",
        description=advise.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    advise.add_arguments(advise_parser)
    advise_parser.set_defaults(run=advise.run)

    explain_parser = commands.add_parser(
        "explain",
        help="Show a request's footprint and the decision kvgate would take now.",
        description="Without --url, computed offline from the flags below; no backend is called "
        "unless --backend is given (for /tokenize, when the model folder has no tokenizer).",
    )
    explain_parser.add_argument("body", help="JSON body file, or - for standard input.")
    explain_parser.add_argument("--url", help="A running kvgate to ask; without it, computed offline from flags.")
    explain_parser.add_argument(
        "--endpoint",
        choices=sorted(set(ROUTE_PATHS.values())),
        help="The route the body is for. Default: chat if the body has messages, else completions.",
    )
    add_settings_arguments(explain_parser, only=EXPLAIN_SETTINGS)
    explain_parser.set_defaults(run=explain_command)

    sim_parser = commands.add_parser(
        "sim",
        help="Run the simulated vLLM whose GPU memory really runs out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    if command == "sim":
        from kvgate.sim import cli as sim_cli

        sim_cli.add_arguments(sim_parser)
    sim_parser.add_argument(
        "--model-folder",
        type=Path,
        default=None,
        help="where to write a preset's config.json for `kvgate serve --model` (default: TMPDIR/kvgate-sim/PRESET)",
    )
    sim_parser.set_defaults(run=sim_command)
    return parser


# Commands that take a pasted vLLM command line (its other options are ignored, not errors).
VLLM_COMMANDS = ("serve", "explain", "capacity", "advise")


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """kvgate's arguments, with vLLM's own command line accepted inline or after `--`.

    Options that are `vllm serve`'s but change nothing kvgate predicts are logged once and
    dropped; anything that is neither kvgate's nor vLLM's is an error, as before."""
    parser = build_parser(argv[0] if argv else None)
    ours, pasted, model = split_vllm_command(argv)
    args, rest = parser.parse_known_args(ours + pasted)
    if rest and args.command not in VLLM_COMMANDS:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        args.ignored_vllm_options = ignored_vllm_options(rest)
    except UnknownFlagError as exc:
        parser.error(str(exc))
    model_dest = "model_config" if args.command in ("capacity", "advise") else "model"
    if model is not None and getattr(args, model_dest, None) is None and Path(model).is_dir():
        setattr(args, model_dest, model)
    return args


def main(argv: list[str] | None = None) -> int:
    quiet_transformers_advice()
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    if argv is None and args.run is serve:  # a `kvgate serve` command line, not a call from Python
        exec_with_malloc_tuning()
    if args.ignored_vllm_options:
        print(ignored_line(args.ignored_vllm_options), file=sys.stderr)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
