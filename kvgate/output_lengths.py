"""Learned output lengths: how many of its max_tokens a request will really generate.

Reserving KV blocks for prompt + max_tokens is safe but wasteful: chat clients send max_tokens
of 1-2k and most answers stop after a few hundred tokens, so a pool reserved that way sits
mostly empty while requests wait (the benchmark's S7 ran at 0.6 x a plain concurrency cap).
vLLM itself allocates blocks as tokens come and preempts (recomputes) a request when the pool
runs dry: a KV shortfall costs latency, never an OOM. So kvgate learns, for a request allowed
M new tokens, the distribution over the last `window` finished sequences of

    v_i(M) = min(L_i, M)   if sequence i stopped by itself (L_i < M_i, its allowance)
             M             if it used its whole allowance M_i

and uses the full M until `min_samples` sequences have finished. A sequence that stopped by itself
revealed its natural length, which is what it would have produced under any allowance; one that
hit its limit might have gone on to any length, so it counts as needing all of M. Traffic whose
answers fill max_tokens (ignore_eos benchmarks, "write 2,000 words") therefore keeps full
reservations, and chat traffic learns its typical lengths from every answer.

The pool is shared, so what must fit is the in-flight requests' outputs together, not each
one's worst case: N answers drawn from lengths of mean m and variance s^2 total about N m, give
or take sqrt(N) s. Each request therefore reserves the mean and reports the variance, and the
budget keeps room for z standard deviations of the sum (z the normal quantile of
`--kv-output-quantile`): N m + z sqrt(N) s instead of N times a per-request quantile, which
over-reserves by a factor that grows with N. The "never fits" check still uses max_tokens.

A request that cannot stop early is another matter: with `ignore_eos` vLLM never stops it at the
end-of-sequence token, and with `min_tokens` not before that many tokens (vllm/sampling_params.py;
the engine masks the stop tokens until then). Whatever others' answers taught, it reserves that
floor (ignore_eos: all of max_tokens), and its length, being the client's choice rather than the
model's, teaches nothing (`released` skips it): a few ignore_eos requests would otherwise read as
"answers fill max_tokens" and inflate everyone's reservations.

Neither the gate nor the predictor owns this: the composition root makes one, hands it to the
predictor as its OutputReserver (kvgate/memory/outputs.py) and to the gate as one of its
observers (kvgate/gate/observer.py), whose releases teach it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from kvgate.gate.observer import Decision, Release
from kvgate.memory.outputs import OutputReservation


class OutputLengths:
    """Recent (allowed, produced) output lengths and the reservation they justify."""

    def __init__(self, quantile: float, window: int = 512, min_samples: int = 16, refresh_every: int = 16) -> None:
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile {quantile} not in (0, 1]")
        self.quantile = quantile
        # Standard deviations of the in-flight total the budget keeps room for (0 at or below
        # the median: a quantile under 0.5 asks for no margin, not a negative one).
        self.z = max(0.0, statistics.NormalDist().inv_cdf(quantile)) if quantile < 1 else 0.0
        self.min_samples = min_samples
        self.refresh_every = refresh_every
        self._samples: deque[tuple[int, int]] = deque(maxlen=window)
        # (max_new_tokens, min_new_tokens) -> reservation, until the next refresh
        self._cache: dict[tuple[int, int], OutputReservation] = {}
        # Bumped whenever the reservations may change (the cache is refreshed): a waiting request
        # estimated since is estimated the same again (kvgate/gate/gate.py Gate._refreshed).
        self.generation = 0
        self._since_refresh = 0

    @property
    def enabled(self) -> bool:
        return self.quantile < 1

    def decided(self, decision: Decision) -> None:
        """Decisions teach nothing: only finished answers do."""

    def released(self, release: Release) -> None:
        """A completed answer whose length the model chose (not forced long by ignore_eos or
        min_tokens) teaches its per-sequence length, when the relay counted it."""
        demand = release.reservation.demand
        if release.outcome == "completed" and release.output_tokens is not None and demand.teaches_output_lengths:
            self.observe(demand.max_new_tokens, release.output_tokens // max(1, demand.sequences))

    def observe(self, max_new_tokens: int, produced: int) -> None:
        """One sequence finished after `produced` tokens out of `max_new_tokens` allowed."""
        if not self.enabled:
            return
        self._samples.append((max_new_tokens, min(max(produced, 0), max_new_tokens)))  # (allowed, produced)
        self._since_refresh += 1
        if self._since_refresh >= self.refresh_every:
            self._cache.clear()
            self.generation += 1
            self._since_refresh = 0

    def reserve(self, max_new_tokens: int, min_new_tokens: int = 0) -> OutputReservation:
        """Output tokens to reserve KV for (the learned mean, never above max_tokens), and the
        variance the budget's margin covers. `min_new_tokens`: what the request will surely
        generate (ignore_eos: max_tokens; else its min_tokens), reserved whatever was learned."""
        floor = min(max(min_new_tokens, 0), max_new_tokens)
        if not self.enabled or floor == max_new_tokens:
            return OutputReservation(max_new_tokens)
        key = (max_new_tokens, floor)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self._learn(max_new_tokens, floor)
        return cached

    def _learn(self, m: int, floor: int) -> OutputReservation:
        if len(self._samples) < self.min_samples:
            return OutputReservation(m)
        # Comparisons rather than min() and max() calls: this runs over the whole window every
        # refresh_every releases, a few hundred builtin calls a request amortised.
        lengths = [
            (produced if produced < m else m) if produced < allowed else m for allowed, produced in self._samples
        ]
        if floor:
            lengths = [x if x > floor else floor for x in lengths]
        mean = statistics.fmean(lengths)
        # Float sums, not statistics.pvariance: its exact Fraction arithmetic cost ~1% of kvgate's
        # CPU under load (py-spy), for precision integers below max_tokens never need.
        variance = math.fsum([(x - mean) ** 2 for x in lengths]) / len(lengths)
        return OutputReservation(max(1, min(m, math.ceil(mean))), variance)

    @property
    def samples(self) -> int:
        return len(self._samples)
