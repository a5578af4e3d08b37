"""The most an idle server ever offers one request, which "could this ever fit" is judged against.

The budget (kvgate/gate/budget.py) knows the live limits and hands out a Ceiling; the predictor
(kvgate/predict.py) knows which engine requests a request becomes and judges them against it.
Both read this module, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.memory.demand import Demand


def transient_charge(unprofiled: int, profiled: int, profiled_cap: int | None) -> int:
    """What transient bytes count against the headroom: the unprofiled ones, plus the profiled
    ones up to `profiled_cap` when the headroom comes from GPU readings (it then includes the part
    of vLLM's profile region the engine emptied; None: a headroom from flags, beside the region)."""
    if profiled_cap is None:
        return unprofiled
    return unprofiled + min(profiled_cap, profiled)


@dataclass(frozen=True)
class Ceiling:
    """vLLM's whole KV pool and the largest transient headroom kvgate has seen (less its safety
    margin); None where unknown, which judges nothing."""

    kv_blocks: int | None
    transient_bytes: int | None
    profiled_cap_bytes: int | None = None

    def transient_need(self, demand: Demand) -> int:
        """What `demand` holds of the transient headroom on an idle server."""
        return transient_charge(demand.transient_bytes, demand.profiled_bytes, self.profiled_cap_bytes)
