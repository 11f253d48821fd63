"""The engine's scheduling rules (ort_kvlayout.serve.scheduler), with numbers alone: no model,
session or cache. A cache here commits whole granules of GRANULE rows per slot, ROW bytes a row."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from ort_kvlayout.serve.batching import resolve_buckets
from ort_kvlayout.serve.scheduler import (
    Limits,
    Running,
    admissions,
    decode_span,
    fit_budget,
    hold_admissions,
    keep_scratch,
    need_bytes,
    next_prefill_rows,
    plan_step,
    prefill_chunks,
    step_rows,
)

GRANULE, ROW = 16, 10


def commit_bytes(tokens: list[int]) -> int:
    return sum(-(-t // GRANULE) * GRANULE for t in tokens) * ROW


def decoding(arrival: int, rows: int) -> Running:
    return Running(arrival, rows, rows + 1)


def prefilling(arrival: int, cached: int, length: int) -> Running:
    return Running(arrival, cached, length)


def test_prefill_chunks_go_oldest_first_until_the_budget():
    slots = [prefilling(3, 0, 50), decoding(1, 10), prefilling(2, 4, 14), None]
    assert prefill_chunks(slots, 20) == [(2, 10), (0, 10)]  # arrival 2 first, 3 gets the rest
    assert prefill_chunks(slots, 10) == [(2, 10)]
    assert prefill_chunks(slots, 100) == [(2, 10), (0, 50)]


def test_step_rows_cover_chunks_slack_decode_rows_and_scratch_rows():
    slots = [decoding(1, 20), None, prefilling(2, 0, 30), decoding(3, 5)]
    limits = Limits(budget=10**9, capacity=64, prefill_chunk=8, slack=4, buckets=(2, 4))
    eager = step_rows(slots, limits, padded=False)
    assert eager == {0: 21, 1: 1, 2: 12, 3: 6}  # the span [0, 4) holds the free slot 1: scratch
    assert step_rows([decoding(1, 20), None], limits, padded=True) == {0: 21, 1: 1}  # bucket 2
    assert step_rows([decoding(1, 20), None], limits, padded=False) == {0: 21}
    # A chunk's rows never pass the capacity, slack included.
    assert step_rows([prefilling(1, 60, 70)], limits, padded=False) == {0: 64}
    assert decode_span(slots, False, limits) == (0, 4)
    assert decode_span([None, prefilling(1, 0, 9)], True, limits) is None


def test_packed_chunks_give_the_free_slots_between_them_the_slack():
    """One packed call runs every slot between the lowest and the highest that prefills: a free
    slot there idles, but holds 1 + slack rows where a CUDA prefill may read past its rows."""
    slots = [prefilling(1, 0, 30), None, decoding(2, 5), None, prefilling(3, 0, 9), None]
    packed = Limits(budget=10**9, capacity=64, prefill_chunk=40, slack=4, packed=True)
    assert step_rows(slots, packed, padded=False) == {0: 34, 1: 5, 2: 6, 3: 5, 4: 13}
    # Without slack (the CPU, bf16/fp32, a preallocated cache) an idle slot needs no rows; not
    # packed, each chunk is its own call.
    assert step_rows(slots, Limits(10**9, 64, 40, packed=True), padded=False) == {0: 30, 2: 6, 4: 9}
    assert step_rows(slots, Limits(10**9, 64, 40, slack=4), padded=False) == {0: 34, 2: 6, 4: 13}


def test_next_prefill_rows_are_the_next_steps_chunks_once_this_ones_are_done():
    """What the cache may commit while a step runs: the chunks the next step would give out were
    this step's done (oldest first, the chunk budget, slack, the capacity); a prompt this step
    completes decodes next and is not among them."""
    limits = Limits(budget=10**9, capacity=64, prefill_chunk=20, slack=4)
    slots = [prefilling(1, 0, 30), decoding(2, 5), prefilling(3, 0, 50), prefilling(4, 0, 10)]
    now = prefill_chunks(slots, 20)
    assert now == [(0, 20)]
    # next: slot 0's last 10 tokens, then 10 of slot 2's; slack on both
    assert next_prefill_rows(slots, now, limits) == {0: 34, 2: 14}
    # slot 0 completed (30 of 30 after a 30-token chunk): slot 2 and slot 3 share the budget
    wide = Limits(budget=10**9, capacity=64, prefill_chunk=30)
    assert next_prefill_rows(slots, prefill_chunks(slots, 30), wide) == {2: 30}
    assert next_prefill_rows([prefilling(1, 50, 70)], [(0, 10)], limits) == {0: 64}  # capacity
    assert next_prefill_rows([decoding(1, 5), None], [], limits) == {}


def test_need_bytes_never_shrinks_what_a_slot_holds():
    assert need_bytes({0: 5}, [40, 0], commit_bytes) == 48 * ROW
    assert need_bytes({1: 17}, [0, 3], commit_bytes) == 32 * ROW


def test_admission_takes_the_lowest_free_slots_while_the_budget_holds():
    limits = Limits(budget=64 * ROW, capacity=256, prefill_chunk=256)
    slots = [decoding(1, 10), None, None]
    held = [11, 0, 0]
    # 16 rows (slot 0) + 16 + 16 fit; a third request of 40 rows would need 48 more.
    assert admissions(slots, [(5, 12), (6, 3), (7, 40)], held, limits, commit_bytes) == [1, 2]
    assert admissions(slots, [(5, 60)], held, limits, commit_bytes) == []  # 16 + 64 > 64
    # Alone, a request is always admitted (submit refused what could never fit).
    assert admissions([None, None], [(5, 500)], [0, 0], limits, commit_bytes) == [0]


def test_admissions_are_held_while_requests_decode_until_company_or_the_wait_is_up():
    # 16 slots: an eighth is 2; the chunk is 100 tokens; up to 3 steps held.
    limits = Limits(budget=1 << 30, capacity=256, prefill_chunk=100, prefill_wait=3)
    slots = [decoding(i, 10) for i in range(14)] + [None, None]
    one = [(20, 30)]
    assert hold_admissions(slots, one, limits, waited=0)
    assert hold_admissions(slots, one, limits, waited=2)
    assert not hold_admissions(slots, one, limits, waited=3)  # the wait is up
    # Company: two prompts fill an eighth of the slots; one of a chunk's tokens fills a call.
    assert not hold_admissions(slots, [(20, 30), (21, 5)], limits, waited=0)
    assert not hold_admissions(slots, [(20, 100)], limits, waited=0)
    # Only the prompts the free slots would take count: one slot free, the second waits anyway.
    one_free = slots[:14] + [decoding(14, 10), None]
    assert hold_admissions(one_free, [(20, 30), (21, 5)], limits, waited=0)
    # A prompt already prefilling: its call runs this step, the waiting join it.
    busy = slots[:13] + [prefilling(13, 0, 40), None, None]
    assert not hold_admissions(busy, one, limits, waited=0)
    # Nothing decodes (the GPU would idle), no slot is free, nothing waits, or no wait asked.
    assert not hold_admissions([None] * 16, one, limits, waited=0)
    assert not hold_admissions([decoding(i, 10) for i in range(16)], one, limits, waited=0)
    assert not hold_admissions(slots, [], limits, waited=0)
    no_wait = Limits(budget=1 << 30, capacity=256, prefill_chunk=100)
    assert not hold_admissions(slots, one, no_wait, waited=0)
    # Below 8 slots an eighth rounds to one request: never held.
    assert not hold_admissions(slots[:3] + [None], one, limits, waited=0)


def test_held_admissions_keep_freed_granules_only_within_the_budget():
    # Slot 0 decodes (20 rows: 2 granules), slot 1 was freed and holds its row-0 granule.
    rows, held = {0: 21}, [20, 1, 0]
    fits = Limits(budget=48 * ROW, capacity=256, prefill_chunk=64)
    assert keep_scratch(rows, held, [1], fits, commit_bytes)  # 32 + 16 rows
    tight = Limits(budget=47 * ROW, capacity=256, prefill_chunk=64)
    assert not keep_scratch(rows, held, [1], tight, commit_bytes)
    assert keep_scratch(rows, held, [], tight, commit_bytes) is (32 * ROW <= tight.budget)


def test_the_budget_pads_then_runs_eagerly_then_preempts_the_newest():
    # Buckets (4,): slots [0, 4) padded; slots 2 and 3 are free: two scratch granules.
    slots = [decoding(1, 30), decoding(2, 14), None, None]
    held = [31, 15, 0, 0]
    padded = Limits(budget=96 * ROW, capacity=256, prefill_chunk=8, buckets=(4,))
    fit = fit_budget(slots, held, padded, commit_bytes)
    assert fit.padded and not fit.victims and fit.rows == {0: 31, 1: 15, 2: 1, 3: 1}
    # Without room for the scratch rows, the decoding span [0, 2) runs eagerly.
    tight = Limits(budget=48 * ROW, capacity=256, prefill_chunk=8, buckets=(4,))
    fit = fit_budget(slots, held, tight, commit_bytes)
    assert not fit.padded and fit.eager_fallback and fit.rows == {0: 31, 1: 15}
    # Without room for both, the request that arrived last goes (its row-0 granule kept).
    tighter = Limits(budget=40 * ROW, capacity=256, prefill_chunk=8, buckets=())
    fit = fit_budget([decoding(1, 31), decoding(2, 15)], [32, 16], tighter, commit_bytes)
    assert fit.victims == [1] and fit.rows == {0: 32}
    # A request alone runs whatever the budget says.
    fit = fit_budget([decoding(1, 100)], [100], tighter, commit_bytes)
    assert fit.victims == [] and fit.rows == {0: 101}


def test_a_request_chunk_bounds_each_request_and_the_budget_goes_on_to_the_next():
    """request_chunk (EngineConfig.graph_chunk): each prefilling request gets at most that many
    tokens a step, the step's budget passing on to the next oldest; step_rows and
    next_prefill_rows follow the same rule."""
    slots = [prefilling(3, 0, 50), decoding(1, 10), prefilling(2, 4, 14), prefilling(4, 0, 6)]
    assert prefill_chunks(slots, 20, request_chunk=8) == [(2, 8), (0, 8), (3, 4)]
    assert prefill_chunks(slots, 12, request_chunk=8) == [(2, 8), (0, 4)]
    assert prefill_chunks(slots, 100, request_chunk=0) == [(2, 10), (0, 50), (3, 6)]
    limits = Limits(budget=10**9, capacity=64, prefill_chunk=20, request_chunk=8)
    assert step_rows(slots, limits, padded=False) == {0: 8, 1: 11, 2: 12, 3: 4}
    now = prefill_chunks(slots, 20, 8)
    assert next_prefill_rows(slots, now, limits) == {0: 16, 2: 14, 3: 6}


def test_a_step_plan_admits_then_fits_then_runs_what_is_left():
    """plan_step: the waiting take the lowest free slots (nothing cached), the budget's fit on
    that view, its victims' slots emptied, and the decode span and chunks of what runs; the same
    as the rules one by one."""
    limits = Limits(budget=10**9, capacity=256, prefill_chunk=32, buckets=(2, 4))
    slots = [decoding(1, 30), None, prefilling(2, 4, 20), None]
    held = [31, 0, 20, 0]
    waiting = [(5, 12), (6, 40)]
    plan = plan_step(slots, waiting, held, limits, commit_bytes)
    assert not plan.held and plan.admitted == [1, 3]
    assert plan.view == [slots[0], Running(5, 0, 12), slots[2], Running(6, 0, 40)]
    assert plan.fit == fit_budget(plan.view, held, limits, commit_bytes) and plan.fit.padded
    assert plan.span == decode_span(plan.view, True, limits) == (0, 2)
    assert plan.chunks == prefill_chunks(plan.view, 32) == [(2, 16), (1, 12), (3, 4)]
    # Without room for both running requests, the newest goes and its slot runs nothing.
    tight = Limits(budget=40 * ROW, capacity=256, prefill_chunk=8)
    plan = plan_step([decoding(1, 31), decoding(2, 15)], [], [32, 16], tight, commit_bytes)
    assert plan.admitted == [] and plan.fit.victims == [1]
    assert plan.view == [decoding(1, 31), None] and plan.span == (0, 1) and plan.chunks == []


def test_a_step_plan_holds_admissions_as_hold_admissions_says():
    limits = Limits(budget=10**9, capacity=256, prefill_chunk=64, prefill_wait=3)
    slots = [decoding(i, 10) for i in range(15)] + [None]
    one = [(20, 30)]
    held = [11] * 15 + [0]
    plan = plan_step(slots, one, held, limits, commit_bytes, waited=0)
    assert plan.held and plan.admitted == [] and plan.view == slots
    assert plan.chunks == [] and plan.span == (0, 15)
    plan = plan_step(slots, one, held, limits, commit_bytes, waited=3)  # the wait is up
    assert not plan.held and plan.admitted == [15] and plan.chunks == [(15, 30)]
    # No free slot or nobody waiting: nothing held, nobody admitted.
    full = slots[:15] + [decoding(15, 10)]
    assert plan_step(full, one, held, limits, commit_bytes).admitted == []
    assert not plan_step(slots, [], held, limits, commit_bytes).held


@st.composite
def step_inputs(draw):
    """Slots (free, or running with rows cached and a sequence of at most the capacity), the
    rows each holds, waiting requests (newer than every running one) and limits."""
    capacity = 64
    n = draw(st.integers(1, 8))
    slots, held = [], []
    for arrival in range(n):
        if draw(st.booleans()):
            slots.append(None)
            held.append(draw(st.sampled_from([0, 1])))  # a freed slot may keep its row 0
            continue
        length = draw(st.integers(1, capacity))
        cached = draw(st.integers(0, length - 1))
        slots.append(Running(arrival, cached, length))
        held.append(cached)
    waiting = [(n + i, draw(st.integers(1, capacity))) for i in range(draw(st.integers(0, 4)))]
    limits = Limits(
        budget=draw(st.integers(16, 600)) * ROW, capacity=capacity,
        prefill_chunk=draw(st.integers(1, 64)), slack=draw(st.integers(0, 4)),
        buckets=resolve_buckets(draw(st.sampled_from([(), (1, 2, 4)])), n),
        packed=draw(st.booleans()),
        prefill_wait=draw(st.sampled_from([0, 2])),
    )  # fmt: skip
    return slots, held, waiting, limits, draw(st.integers(0, 3))


@given(step_inputs())
def test_every_step_plan_keeps_the_rules(inputs):
    """Whatever the slots and the queue: the oldest waiting take the lowest free slots (or all
    wait, held), the victims are the newest running requests, what runs fits the budget unless
    one request runs alone, and the decode span and chunks are those of what runs."""
    slots, held, waiting, limits, waited = inputs
    plan = plan_step(slots, waiting, held, limits, commit_bytes, waited)
    free = [s for s, r in enumerate(slots) if r is None]
    assert plan.admitted == free[: len(plan.admitted)] and len(plan.admitted) <= len(waiting)
    assert not (plan.held and plan.admitted)
    admitted = dict(zip(plan.admitted, waiting))
    for s, r in enumerate(plan.view):
        if s in plan.fit.victims:
            assert r is None
        elif s in admitted:
            assert r == Running(admitted[s][0], 0, admitted[s][1])
        else:
            assert r == slots[s]
    before = [r for r in [*slots, *(Running(a, 0, n) for a, n in waiting)] if r is not None]
    kept = [r for r in plan.view if r is not None]
    gone = [r for r in before if r not in kept and r.arrival < len(slots) + len(plan.admitted)]
    assert all(g.arrival > k.arrival for g in gone for k in kept)  # the newest go first
    after = [min(h, 1) if s in plan.fit.victims else h for s, h in enumerate(held)]
    if len(kept) > 1:
        assert need_bytes(plan.fit.rows, after, commit_bytes) <= limits.budget
    assert plan.span == decode_span(plan.view, plan.fit.padded, limits)
    assert plan.chunks == prefill_chunks(plan.view, limits.prefill_chunk)
    for s, take in plan.chunks:
        r = plan.view[s]
        assert r.length - r.cached != 1 and 1 <= take <= r.length - r.cached
