"""The one percentile definition of every benchmark table (TTFT, added latency, estimate cost).

Linear interpolation between the closest ranks: the standard library's
`statistics.quantiles(method="inclusive")`, numpy's default, R's type 7; at q=0.5 it is
`statistics.median`. Two definitions in one report (nearest rank in one table, floor index in
another) made the same p99 mean different things.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The q-quantile of `samples` (q in hundredths: 0.5, 0.99); None without samples."""
    hundredths = round(q * 100)
    if not 0 < hundredths < 100 or abs(q * 100 - hundredths) > 1e-9:
        raise ValueError(f"q={q}: a percentile in hundredths strictly between 0 and 1")
    if not samples:
        return None
    if len(samples) == 1:
        return float(samples[0])
    return statistics.quantiles(samples, n=100, method="inclusive")[hundredths - 1]
