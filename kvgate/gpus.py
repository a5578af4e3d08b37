"""GPUs by name: the total memory CUDA reports for each, shared by `kvgate advise` and the simulator.

Shared vocabulary (it imports nothing of kvgate but units). Totals are what
`torch.cuda.mem_get_info` reports, slightly below the marketing size: 79.25 GiB on an H100 80GB
(the OOM message of docs/sources.md#large-max-num-batched-tokens); the others are the totals the
public start-up logs of docs/calibration.md print or imply (T4 14.56 GiB, A10 22.07 GiB, RTX 5090
31.36 GiB, A100-40GB 39.39 GiB, A100-80GB 79.15 GiB), the RTX 3090's 23.58 GiB (vLLM issue #10517)
and the B200's 178.36 GiB (vLLM PR #19480, docs/sources.md#kv-cache-memory-pr).
"""

from __future__ import annotations

import re

from kvgate.units import GiB, parse_size

GPUS: dict[str, int] = {
    "t4-16gb": int(14.56 * GiB),
    "a10-24gb": int(22.07 * GiB),
    "l4-24gb": int(22.05 * GiB),
    "rtx-3090-24gb": int(23.58 * GiB),
    "rtx-4090-24gb": int(23.64 * GiB),
    "rtx-5090-32gb": int(31.36 * GiB),
    "a100-40gb": int(39.39 * GiB),
    "a100-80gb": int(79.15 * GiB),
    "h100-80gb": int(79.25 * GiB),
    "h200-141gb": int(139.8 * GiB),
    "b200-192gb": int(178.36 * GiB),
}
# Cards older than Ampere (compute capability below 8.0): vLLM 0.8 - 0.10 run them on the V0
# engine (V1 needs 8.0 for its FlashAttention backend), as the RTX 2080 Ti log of
# docs/calibration.md shows on 0.8.5.
PRE_AMPERE = ("t4", "v100", "2080", "titan-rtx", "quadro-rtx")


def gpu_total_bytes(spec: str) -> int:
    """A named GPU's capacity, or a byte count in vLLM's units ('85899345920', '80GiB', '80G')."""
    try:
        return GPUS[gpu_name(spec)]
    except KeyError:
        pass
    try:
        size = parse_size(spec)
    except ValueError:
        raise KeyError(f"unknown GPU {spec!r}; names: {', '.join(sorted(GPUS))}, or a size (80GiB)") from None
    assert isinstance(size, int)
    return size


def gpu_name(spec: str) -> str:
    """The table's name for `spec` as nvidia-smi or a person writes it ('NVIDIA H100 80GB HBM3',
    'h100', 'A100-SXM4-80GB'): the one entry whose card and, where given, memory it names
    (KeyError: none, or more than one)."""
    text = re.sub(r"[\s_]+", "-", spec.strip().lower()).replace("nvidia-", "").replace("geforce-", "")
    if text in GPUS:
        return text
    tokens = text.split("-")
    sized = any(re.fullmatch(r"\d+gb", t) for t in tokens)
    matches = [
        key
        for key in GPUS
        if _contains(tokens, key.rsplit("-", 1)[0].split("-")) and (key.rsplit("-", 1)[1] in tokens or not sized)
    ]
    if len(matches) != 1:
        raise KeyError(spec)
    return matches[0]


def is_pre_ampere(spec: str) -> bool:
    return any(part in spec.lower() for part in PRE_AMPERE)


def _contains(tokens: list[str], part: list[str]) -> bool:
    """Whether `part` is a run of whole tokens of `tokens` ('l4' is not in 'l40s')."""
    return any(tokens[i : i + len(part)] == part for i in range(len(tokens) - len(part) + 1))
