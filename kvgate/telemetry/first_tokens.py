"""vLLM's count of first tokens, read against kvgate's own account: how many of the non-streaming
requests' engine requests have surely finished their prefill (kvgate/gate/plain_prefills.py says
why the result is a lower bound whichever of them finished, and what it says of the requests).

Pure: the page's figures and the gate's account come in, a number goes out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FirstTokenAccount:
    """What kvgate's requests may have put in vLLM's count (kvgate/gate/view.py
    `GateView.first_token_account`)."""

    accounted: int  # for good: released, or a stream's first token shown
    others_open: int  # the most the in-flight requests that are no plain candidates may add
    in_flight: int  # engine requests kvgate has in flight (prompts x n)


class FirstTokenCount:
    """The count and the account, started again together whenever they surely match."""

    def __init__(self) -> None:
        self._base: tuple[float, int] | None = None  # (count, accounted) when last they matched

    def finished(self, count: float, running: float, waiting: float, account: FirstTokenAccount, settled: bool) -> int:
        """At least how many of the plain candidates' engine requests have finished their prefill.

        The base moves (and 0 comes back) at the first page, when the count went back (a new
        engine life), and when kvgate had nothing in flight and admitted or released nothing
        while the page was fetched (`settled`): every first token of a released request is in the
        page then. 0 while vLLM runs or queues more engine requests than kvgate has in flight:
        someone bypasses kvgate, and their first tokens would count as kvgate's."""
        base = self._base
        if base is None or count < base[0] or (settled and account.in_flight == 0):
            self._base = (count, account.accounted)
            return 0
        if running + waiting > account.in_flight:
            return 0
        return int(count - base[0]) - (account.accounted - base[1]) - account.others_open
