"""Byte units, defined once for kvgate, its simulator, the benchmarks and the tests.

Shared vocabulary: it imports nothing of kvgate, so the memory model and the simulator (which must
not import each other) may both use it. Binary units are what PyTorch and vLLM print ("49.94 GiB");
decimal ones are what GPU names say ("80GB"). `vllm serve` flags take both (`1k` decimal, `1K`
binary, in vLLM's `human_readable_int`): parse_size reads every byte flag of kvgate that way.
"""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12

# vLLM 0.32.0's `human_readable_int` (vllm/utils/argparse_utils.py), the type of its byte and
# token-count flags (--kv-cache-memory-bytes, --max-num-batched-tokens, ...): a lower-case suffix
# is decimal and takes a fraction, an upper-case one binary and takes none.
_VLLM_DECIMAL = {"k": KB, "m": MB, "g": GB, "t": TB}
_VLLM_BINARY = {"K": KiB, "M": MiB, "G": GiB, "T": TiB}
# The units vLLM and PyTorch print sizes in ("49.94 GiB"), so a logged size can be pasted back.
_PRINTED = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "KB": KB, "MB": MB, "GB": GB, "TB": TB}
_NUMBER = r"(\d+(?:\.\d+)?)"


def parse_size(value: object) -> object:
    """A byte (or token) count as vLLM's `human_readable_int` reads it (`1k` = 1,000, `1K` =
    1,024, `25.6k`, `2G` = 2 GiB, a plain integer) or as vLLM logs it (`49.94GiB`, `100 MiB`,
    `80GB`). A non-string passes through for the caller's own validation; a string that is none of
    these is a ValueError saying what is accepted (vLLM's own message for `1.5K`)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if match := re.fullmatch(_NUMBER + r"([kmgtKMGT])", text):
        number, suffix = match.groups()
        if suffix in _VLLM_DECIMAL:
            return int(float(number) * _VLLM_DECIMAL[suffix])
        if "." in number:
            raise ValueError(
                f"Decimals are not allowed with binary suffixes like {suffix}. "
                f"Did you mean to use {number}{suffix.lower()} instead?"
            )
        return int(number) * _VLLM_BINARY[suffix]
    if match := re.fullmatch(_NUMBER + r"\s*(B|[KMGT]i?B)", text):
        return int(float(match[1]) * _PRINTED[match[2]])
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"{value!r} is not a size: give an integer, or a number with vLLM's suffixes (1k = 1000, "
            "1K = 1024, 25.6k, 2G = 2 GiB) or the units vLLM logs (49.94GiB, 100MiB, 80GB)"
        ) from None
