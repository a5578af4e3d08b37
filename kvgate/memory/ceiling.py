"""The most an idle server ever offers one request, which "could this ever fit" is judged against.

The budget (kvgate/gate/budget.py) knows the live limits and hands out a Ceiling; the predictor
(kvgate/predict.py) knows which engine requests a request becomes and judges them against it.
Both read this module, so neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate.memory.demand import Demand


def transient_charge(unprofiled: int, profiled: int, profiled_cap: int | None, segment_overhead: float = 0.0) -> int:
    """What transient bytes count against the headroom: the unprofiled ones, plus the profiled
    ones up to `profiled_cap` when the headroom comes from GPU readings (it then includes the part
    of vLLM's profile region the engine emptied; None: a headroom from flags, beside the region).
    Profiled bytes that come out of free memory take the caching allocator's segments, not just
    their bytes: `segment_overhead` is the profile step's segments beyond its allocated peak, as a
    share of the peak (kvgate/memory/activation.py `profile_segment_overhead_bytes`), charged in
    proportion: S13's 400 MiB region takes 480 MiB."""
    if profiled_cap is None:
        return unprofiled
    charged = min(profiled_cap, profiled)
    return unprofiled + charged + math.ceil(charged * segment_overhead)


def transient_need_of_profiled(profiled: int, profiled_cap: int | None, segment_overhead: float) -> int:
    """`transient_charge`'s profiled part."""
    return transient_charge(0, profiled, profiled_cap, segment_overhead)


@dataclass(frozen=True)
class Ceiling:
    """vLLM's whole KV pool and the largest transient headroom kvgate has seen (less its safety
    margin); None where unknown, which judges nothing."""

    kv_blocks: int | None
    transient_bytes: int | None
    profiled_cap_bytes: int | None = None
    segment_overhead: float = 0.0

    def profiled_need(self, demand: Demand) -> int:
        """The part of `transient_need` that is the profile region's tensors at their segments."""
        return transient_need_of_profiled(demand.profiled_bytes, self.profiled_cap_bytes, self.segment_overhead)

    def transient_need(self, demand: Demand) -> int:
        """What `demand` holds of the transient headroom on an idle server."""
        return transient_charge(
            demand.transient_bytes, demand.profiled_bytes, self.profiled_cap_bytes, self.segment_overhead
        )
