"""`kvgate serve | capacity | explain | sim`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import httpx

from app import capacity
from app.settings import Settings, add_settings_arguments, settings_from_args
from app.sim import cli as sim_cli
from app.vllm_flags import (
    UnknownFlagError,
    ignored_line,
    ignored_vllm_options,
    split_vllm_command,
)


def parse_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


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


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The format shows neither the caller nor the thread or process: do not collect them for
    # every record (the caller is a walk up the stack, the process id a system call). At
    # --log-level info that is a quarter of each decision line's cost.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.getLogger("httpx").setLevel(logging.WARNING)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.server import create_app

    settings = settings_from_args(args)
    configure_logging(settings.log_level)
    host, port = parse_listen(settings.listen)
    uvicorn.run(
        create_app(settings), host=host, port=port, log_level=settings.log_level,
        access_log=False, timeout_keep_alive=30,
        # The backend's own Date and Server headers pass through untouched; do not add ours.
        server_header=False, date_header=False,
        # X-Forwarded-* go to vLLM untouched; kvgate never reads the client's address itself.
        proxy_headers=False,
    )
    return 0


def explain_command(args: argparse.Namespace) -> int:
    raw = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    if args.url:
        params = {"endpoint": args.endpoint} if args.endpoint else None
        response = httpx.post(args.url.rstrip("/") + "/kvgate/explain", content=raw, params=params, timeout=30)
        print(json.dumps(response.json(), indent=2))
        return 0 if response.status_code == 200 else 1
    return asyncio.run(_explain_offline(settings_from_args(args), raw, args.endpoint))


async def _explain_offline(settings: Settings, raw: bytes, endpoint: str | None) -> int:
    from app.explain import explain
    from app.openai import ApiError
    from app.runtime import Runtime

    runtime = Runtime(settings)
    try:
        runtime.configure_offline()
        print(json.dumps(await explain(runtime, raw, endpoint), indent=2))
        return 0
    except ApiError as error:
        print(json.dumps(error.body(), indent=2))
        return 1
    finally:
        await runtime.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser(
        "serve", help="Run the admission-control proxy in front of vLLM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_settings_arguments(serve_parser)
    serve_parser.set_defaults(run=serve)

    capacity_parser = commands.add_parser("capacity", help="KV cache capacity as vLLM computes it.")
    capacity.add_arguments(capacity_parser)
    capacity_parser.set_defaults(run=capacity.run)

    explain_parser = commands.add_parser(
        "explain", help="Show a request's footprint and the decision kvgate would take now."
    )
    explain_parser.add_argument("body", help="JSON body file, or - for standard input.")
    explain_parser.add_argument("--url", help="A running kvgate to ask; without it, computed offline from flags.")
    explain_parser.add_argument("--endpoint", choices=["chat", "completions"], help="Default: chat if the body has messages.")
    add_settings_arguments(explain_parser)
    explain_parser.set_defaults(run=explain_command)

    sim_parser = commands.add_parser(
        "sim", help="Run the simulated vLLM whose GPU memory really runs out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sim_cli.add_arguments(sim_parser)
    sim_parser.set_defaults(run=sim_cli.run)
    return parser


# Commands that take a pasted vLLM command line (its other options are ignored, not errors).
VLLM_COMMANDS = ("serve", "explain", "capacity")


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """kvgate's arguments, with vLLM's own command line accepted inline or after `--`.

    Options that are `vllm serve`'s but change nothing kvgate predicts are logged once and
    dropped; anything that is neither kvgate's nor vLLM's is an error, as before."""
    parser = build_parser()
    ours, pasted, model = split_vllm_command(argv)
    args, rest = parser.parse_known_args(ours + pasted)
    if rest and args.command not in VLLM_COMMANDS:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        args.ignored_vllm_options = ignored_vllm_options(rest)
    except UnknownFlagError as exc:
        parser.error(str(exc))
    model_dest = "model_config" if args.command == "capacity" else "model"
    if model is not None and getattr(args, model_dest, None) is None and Path(model).is_dir():
        setattr(args, model_dest, model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    if argv is None and args.run is serve:  # a `kvgate serve` command line, not a call from Python
        exec_with_malloc_tuning()
    if args.ignored_vllm_options:
        print(ignored_line(args.ignored_vllm_options), file=sys.stderr)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
