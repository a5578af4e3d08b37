"""A waiting head's plan (kvgate/gate/backfill.py `HeadReservation.plan`) starts from a copy of the
gate's ledger (`Ledger.copy`) instead of reserving every in-flight request again: the same start
and companions as that, and a copy that changes apart from the ledger it came from."""

from __future__ import annotations

import random

from kvgate.gate.backfill import HeadReservation
from kvgate.gate.budget import Budget
from kvgate.gate.ledger import Ledger, Reservation
from kvgate.memory.demand import Demand
from kvgate.memory.sampler import SamplerCost, SamplerUse

# A sampler of two-token rows (tests/unit/test_gate.py's): the rows' stage stays small beside the limits.
COST = SamplerCost(vocab_size=2, dtype_bytes=1, max_num_seqs=1000, max_num_batched_tokens=2000)


def random_demand(rng: random.Random) -> Demand:
    """A streaming request with a shared prefix from a small pool (so blocks are shared), its
    own blocks, prefill terms and sampled rows."""
    prefix = tuple(range(rng.choice([0, 100, 200]), rng.choice([0, 100, 200]) + rng.randint(0, 6)))
    rows = rng.randint(1, 4)
    return Demand(
        prompt_tokens=16 * len(prefix) + rng.randint(1, 400),
        max_new_tokens=rng.choice([16, 128, 512]),
        shared_block_hashes=prefix,
        private_blocks=rng.randint(1, 12),
        transient_prefill_bytes=rng.choice([0, 40, 90]),
        profiled_prefill_bytes=rng.choice([0, 30, 70]),
        sampler=SamplerUse(COST, rows, rng.randint(1, 400), logprobs=rng.random() < 0.3),
    )


def plan_reserving_again(
    head_demand: Demand, ledger: Ledger, budget: Budget, ends: dict[int, float], now: float
) -> tuple[float, Ledger]:
    """The plan as it was made until session 41: every in-flight request reserved again in a new
    ledger, latest end first, while the pool could hold the head's private blocks beside them,
    then given back, earliest end first, until the head fits."""
    companions = Ledger(pool=lambda: budget.kv_blocks, peak_segment_rows=ledger.peak_segment_rows, snapshots=False)
    known = sorted(((ends[r.id], r) for r in ledger.reservations()), key=lambda pair: pair[0], reverse=True)
    kv_limit = budget.kv_limit()
    head_private = 0 if kv_limit is None else min(head_demand.private_blocks, max(kv_limit, 0))
    taken: list[tuple[float, Reservation]] = []
    for end, reservation in known:
        copy = companions.reserve(reservation.demand)
        if not reservation.prefill_open:
            companions.end_prefill(copy)
        taken.append((end, copy))
        if kv_limit is not None and companions.kv_blocks + head_private > kv_limit:
            break
    start = now
    while taken and budget.shortfall(head_demand, companions) is not None:
        end, copy = taken.pop()
        companions.release(copy)
        start = max(start, end)
    return start, companions


def test_the_plan_from_a_copy_equals_the_plan_that_reserved_every_request_again() -> None:
    rng = random.Random(41)
    compared = waited = 0
    for _ in range(300):
        budget = Budget(
            kv_blocks=rng.choice([40, 80, 160]),
            transient_headroom_bytes=rng.choice([150, 300, 600]),
            transient_margin=0.0,
        )
        ledger = Ledger(pool=lambda budget=budget: budget.kv_blocks)
        ends: dict[int, float] = {}
        for _ in range(rng.randint(1, 14)):
            reservation = ledger.reserve(random_demand(rng))
            ends[reservation.id] = rng.uniform(0.0, 10.0)
            if rng.random() < 0.5:
                ledger.end_prefill(reservation)
        head = random_demand(rng)
        now = 0.5
        plan = HeadReservation.plan("head", head, ledger, budget, lambda r, ends=ends: ends[r.id], now)
        start, companions = plan_reserving_again(head, ledger, budget, ends, now)
        assert plan.start == start
        assert plan.companions.kv_blocks == companions.kv_blocks
        assert plan.companions.in_flight == companions.in_flight
        assert plan.companions.step() == companions.step()
        compared += 1
        waited += start > now
    assert compared == 300
    assert waited > 50  # the heads did wait for companions to leave, in many of the cases


def test_a_copy_changes_apart_from_the_ledger_it_came_from() -> None:
    rng = random.Random(7)
    ledger = Ledger(pool=lambda: 1000)
    reservations = [ledger.reserve(random_demand(rng)) for _ in range(6)]
    before = (ledger.kv_blocks, ledger.step(), ledger.in_flight)
    twin = ledger.copy()
    assert (twin.kv_blocks, twin.step(), twin.in_flight) == before
    twin.end_prefill(twin.reservation(reservations[0].id))
    for reservation in reservations[1:4]:
        twin.release(twin.reservation(reservation.id))
    twin.reserve(random_demand(rng))
    assert (ledger.kv_blocks, ledger.step(), ledger.in_flight) == before
    assert reservations[0].prefill_open
    assert not any(r.released for r in reservations)
    new = ledger.reserve(random_demand(rng))  # ids stay the ledger's own: no copy's id is reused
    assert new.id not in {r.id for r in reservations}
    assert twin.in_flight == 4
