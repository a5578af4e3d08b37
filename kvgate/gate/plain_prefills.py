"""Non-streaming requests' prefills, closed on the engine's count of first tokens.

A stream shows its first token, and the ledger frees its prefill-only terms then
(`Ledger.end_prefill`). A plain request (no `stream`: lm-eval's local-completions, batch jobs, most
SDK calls) shows nothing until its whole answer, so its prefill terms would stay reserved while it
decodes: a burst of them on a headroom that holds about one step goes in at the pace of whole
answers, not of first tokens (bench/results/nonstream-session32: held-out H1 0.37 x the oracle).
A stream of several engine requests is the same: its first token is one of theirs (until each of
its choices has shown one: kvgate/http/choice_watch.py, `Ledger.end_every_prefill`).

vLLM counts first tokens: `vllm:time_to_first_token_seconds` is observed once per engine request
when its prefill ends (vllm 0.32.0 v1/metrics/stats.py `IterationStats.update_from_output`, the
`is_prefilling` branch; the same histogram since V1's first releases). It does not say whose. So
the count is turned into a number, never into names:

    k = (first tokens since the baseline) - (first tokens kvgate's other requests can account
        for: every one released or whose stream showed it, and every engine request still in
        flight that is not a plain candidate)

at most the first tokens the candidates' engine requests have put in the count.

A candidate may be several engine requests: a list of prompts is one engine request per prompt
(vllm 0.32.0 entrypoints/openai/completion/serving.py `_create_completion`, request id
`{id}-{i}`), and `n` > 1 fans each out into n children, each added to the engine core and followed
by its own output state, so each child observes the histogram once (v1/engine/async_llm.py
`AsyncLLM.add_request`, v1/engine/parallel_sampling.py `ParentRequest.get_child_info`,
v1/engine/output_processor.py `OutputProcessor.process_outputs`, `is_prefilling` per request
state). Its prefill terms cover all of them and leave only when all have finished. An unfinished
candidate of S engine requests hides at most S - 1 first tokens, so whichever engine requests
finished,

    finished >= k - sum over the candidates of (S - 1)

candidates have finished all of theirs (with k <= sum over finished S + sum over the others
(S - 1) = sum S - (candidates - finished)). The ledger then charges the candidates' summed prefill
terms less the `finished` smallest values of each term (`relief`), which is at least what any set
of that many finished candidates leaves: no choice of who finished can be under-charged. The
largest one-step term and the step pairs keep every candidate until all of them have finished (the
largest of any remaining few is at most the largest of all).

Requests that bypass kvgate add first tokens kvgate cannot account for; the telemetry stops
relieving while vLLM runs or queues more requests than kvgate has in flight
(kvgate/telemetry/live.py).
"""

from __future__ import annotations

import bisect
import copy
import heapq
from dataclasses import dataclass

from kvgate.memory.demand import Demand


@dataclass(frozen=True)
class Relief:
    """What the `finished` smallest candidates put in each summed prefill term."""

    held: int = 0
    profiled_prefill: int = 0
    profiled_residual: int = 0
    upproject: int = 0
    # Every candidate finished: their one-step terms and step pairs leave the step's maxima too
    # (`without_candidates`); while one may still prefill, the maxima keep them all.
    all_finished: bool = False


NO_RELIEF = Relief()


class PlainPrefills:
    """The plain candidates, how many of them have surely finished, and the first-token account."""

    def __init__(self) -> None:
        self._candidates: dict[int, Demand] = {}  # reservation id -> demand, while its prefill is open
        # the candidates' values in the ledger's sorted maxima (Ledger._open_prefills, _open_pairs)
        self.one_steps: list[int] = []
        self.pairs: list[int] = []
        self.finished = 0  # a lower bound on the candidates whose every prefill has ended
        self._hidden = 0  # the first tokens unfinished candidates may hide: sum of (S - 1)
        # First tokens kvgate's requests may have put in vLLM's count: `accounted` grows for good
        # (released, or a stream's first token shown), `others_open` is the rest in flight that
        # is no candidate (streams before their first token, V2 prompt logprobs' shared steps).
        self.accounted = 0
        self.others_open = 0
        self._relief: Relief | None = NO_RELIEF

    def copy(self) -> PlainPrefills:
        """The same candidates and account, changed apart from these from now on (`Ledger.copy`)."""
        twin = copy.copy(self)
        twin._candidates = dict(self._candidates)
        twin.one_steps = list(self.one_steps)
        twin.pairs = list(self.pairs)
        return twin

    @staticmethod
    def eligible(demand: Demand) -> bool:
        """Without V2 prompt logprobs' shared-step extras, which the ledger keeps per reservation;
        any number of engine requests (prompts x n): `set_finished` counts a candidate finished
        only once all of them may have. Not beam search: its engine requests come one output
        token after another, each prefilling the prompt again, so its prefill never ends before
        the request does."""
        return demand.shared_step is None and demand.beam_iterations == 1

    def reserved(self, demand: Demand) -> None:
        """A request was admitted: until it is a candidate, each of its engine requests may count."""
        self.others_open += demand.engine_requests

    def add(self, reservation_id: int, demand: Demand, one_step: int) -> None:
        """An admitted request turned out plain (its prefill still open, `eligible`); `one_step`:
        its value in the ledger's largest-prefill list."""
        self._candidates[reservation_id] = demand
        self._hidden += demand.sequences - 1
        bisect.insort(self.one_steps, one_step)
        bisect.insort(self.pairs, demand.step_pair_bytes)
        self.others_open -= demand.engine_requests
        self._relief = None

    def first_token_shown(self, demand: Demand) -> None:
        """A stream showed its first token (one engine request: `Ledger.end_prefill`)."""
        self.others_open -= demand.engine_requests
        self.accounted += demand.engine_requests

    def released(self, reservation_id: int, demand: Demand, shown: bool, one_step: int) -> None:
        """A request left the ledger; `shown`: its first token was accounted already."""
        if self._candidates.pop(reservation_id, None) is not None:
            self._hidden -= demand.sequences - 1
            del self.one_steps[bisect.bisect_left(self.one_steps, one_step)]
            del self.pairs[bisect.bisect_left(self.pairs, demand.step_pair_bytes)]
            # Had it finished, it may have been one of `finished`: the bound keeps only the others.
            self.finished = max(0, min(self.finished - 1, len(self._candidates)))
            self.accounted += demand.engine_requests
            self._relief = None
        elif not shown:
            self.others_open -= demand.engine_requests
            self.accounted += demand.engine_requests

    def all_shown(self, reservation_id: int, demand: Demand, one_step: int) -> None:
        """A stream of several engine requests showed a token of each (kvgate/http/choice_watch.py):
        its first tokens are accounted for good, as a release's, and it is no candidate any more."""
        self.released(reservation_id, demand, False, one_step)

    def set_finished(self, first_tokens: int) -> bool:
        """The engine's evidence: at least `first_tokens` of the candidates' engine requests have
        finished their prefill, so at least that many less the `S - 1` each unfinished candidate
        may hide have finished all of theirs. True if the bound moved."""
        count = max(0, min(first_tokens - self._hidden, len(self._candidates)))
        if count == self.finished:
            return False
        self.finished = count
        self._relief = None
        return True

    @property
    def relief(self) -> Relief:
        """The `finished` smallest candidates' share of each summed prefill term (cached)."""
        if self._relief is None:
            k = self.finished
            demands = self._candidates.values()
            self._relief = (
                Relief(
                    held=sum(heapq.nsmallest(k, (d.transient_held_bytes for d in demands))),
                    profiled_prefill=sum(heapq.nsmallest(k, (d.profiled_prefill_bytes for d in demands))),
                    profiled_residual=sum(heapq.nsmallest(k, (d.profiled_residual_bytes for d in demands))),
                    upproject=sum(heapq.nsmallest(k, (d.upproject_bytes for d in demands))),
                    all_finished=k == len(self._candidates),
                )
                if k
                else NO_RELIEF
            )
        return self._relief

    def __contains__(self, reservation_id: int) -> bool:
        return reservation_id in self._candidates

    def __len__(self) -> int:
        return len(self._candidates)


def largest_without(values: list[int], excluded: list[int], count: int) -> list[int]:
    """The `count` largest of sorted `values` less the sub-multiset `excluded` (sorted too),
    largest first: the ledger's maxima once every candidate's prefill has ended."""
    out: list[int] = []
    i, j = len(values) - 1, len(excluded) - 1
    while i >= 0 and len(out) < count:
        if j >= 0 and values[i] == excluded[j]:
            j -= 1
        else:
            out.append(values[i])
        i -= 1
    return out
