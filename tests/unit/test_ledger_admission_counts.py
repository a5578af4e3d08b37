"""The ledger's counts of shared prompt blocks, each checked against walking the in-flight requests'
hashes (the slow path) over random admissions and releases with prefixes shared between requests:
what it counts as it reserves for the traffic record (Reservation.shared_blocks_at_admission, and
transient_bytes_at_admission against its worst step worked out again right after), and the blocks
a candidate would add (Ledger.new_blocks, which the budget weighs every admission by)."""

from __future__ import annotations

import random

from kvgate.gate.ledger import Ledger, Reservation
from kvgate.memory.demand import Demand


def _demand(rng: random.Random) -> Demand:
    prefix = rng.randint(0, 6)  # a common prefix of up to 6 blocks, then the request's own
    hashes = tuple(range(prefix)) + tuple(rng.randint(100, 10_000) for _ in range(rng.randint(0, 4)))
    return Demand(
        rng.randint(1, 4_000),
        rng.randint(1, 500),
        hashes,
        rng.randint(0, 3),
        rng.randint(0, 2**30),
        transient_held_bytes=rng.choice((0, rng.randint(0, 2**24))),
        step_tokens=rng.choice((None, rng.randint(1, 8_192))),
    )


def test_the_ledgers_shared_block_counts_are_the_slow_walks() -> None:
    rng = random.Random(37)
    ledger = Ledger(pool=lambda: 50_000)
    held: list[Reservation] = []
    shared_seen = 0
    for _ in range(3_000):
        if held and rng.random() < 0.45:
            ledger.release(held.pop(rng.randrange(len(held))))
            continue
        others = [set(r.hashes) for r in held]
        demand = _demand(rng)
        slow_new = sum(1 for h in set(demand.shared_block_hashes) if not any(h in o for o in others))
        assert ledger.new_blocks(demand) == slow_new + demand.private_blocks
        reservation = ledger.reserve(demand)
        held.append(reservation)
        slow_shared = sum(1 for h in reservation.hashes if any(h in o for o in others))
        assert reservation.shared_blocks_at_admission == slow_shared
        assert reservation.transient_bytes_at_admission == ledger.transient_bytes
        shared_seen += slow_shared
    assert shared_seen > 0  # prefixes were shared: the count was exercised, not only zeros
