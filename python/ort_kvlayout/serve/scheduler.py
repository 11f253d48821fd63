"""The engine's decisions for one step, as pure functions of what the slots hold.

    view = [Running(arrival, cached, length) or None for each slot]
    plan = plan_step(view, waiting, held, limits, commit_bytes, waited)  # the whole step:
    plan.held, plan.admitted, plan.fit, plan.view, plan.span, plan.chunks

composed of the rules one by one:

    hold = hold_admissions(view, waiting, limits, waited)           # admit nobody this step?
    slots = admissions(view, waiting, held, limits, commit_bytes)   # where the waiting go
    fit = fit_budget(view, held, limits, commit_bytes)              # rows, padding, victims
    chunks = prefill_chunks(view, limits.prefill_chunk, limits.request_chunk)  # (slot, tokens)

No session, cache or request object: the engine (engine.py) passes a view of its slots, the rows
each slot holds now (`held`, the cache's tokens) and the cache's byte count of a set of rows
(`commit_bytes`), and applies what comes back: its step applies the plan of the slots as they
are, and its pipeline plans the step after a call in flight with the same function on the view
that call leaves; tests/serve/test_scheduler.py checks the rules with
numbers alone. The rules (docs/SERVING.md, "One step"):

* rows: a prefilling request writes up to its next chunk (plus the rows a CUDA prefill may read
  past it, `slack`), a decoding one its next row; a slot of the decode range that decodes
  nothing writes one scratch row (serve/batching.py); packed (one call for the step's chunks),
  a free slot between the lowest and the highest slot that prefills holds `1 + slack` rows
  where slack > 0 (it idles, but a CUDA prefill's key tiles may be read wherever the call has
  rows: the same guard as a chunk's slack);
* admission: waiting requests, oldest first, take the lowest free slot while the step's rows
  with their whole sequence fit the budget (a request alone is always admitted); with
  `prefill_wait`, a step where requests decode and none prefills admits nobody, for up to that
  many steps, until the prompts the free slots would take fill a chunk or an eighth of the
  slots: they then share one prefill call instead of one call each (hold_admissions);
* the budget: when the step's rows do not fit, the decode call runs its span eagerly if that
  fits (no scratch rows past it), else the running request that arrived last is preempted, and
  so on; a preempted slot keeps its row-0 granule until the next step (KvCache.release keep=1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .batching import decode_range

__all__ = [
    "Fit",
    "Limits",
    "Running",
    "StepPlan",
    "admissions",
    "decode_span",
    "fit_budget",
    "hold_admissions",
    "keep_scratch",
    "need_bytes",
    "next_prefill_rows",
    "plan_step",
    "prefill_chunks",
    "step_rows",
]

CommitBytes = Callable[[list[int]], int]  # rows per slot -> bytes the cache commits for them


class Running(NamedTuple):
    """A running request as the scheduler sees it: its arrival order, the rows its slot holds,
    and its sequence length (prompt + generated); decoding when one token is left to feed. (A
    tuple: the engine builds one per slot, several times a step.)"""

    arrival: int
    cached: int
    length: int

    @property
    def decoding(self) -> bool:
        return self.length - self.cached == 1


@dataclass(frozen=True)
class Limits:
    """budget: KV bytes; capacity: rows a slot holds at most; prefill_chunk: prompt tokens a step
    prefills; slack: rows a prefill may read past its chunk; buckets: padded decode sizes (());
    packed: a step's prefill chunks run as one call over the slots between them; prefill_wait:
    steps a waiting request may be held so that several prompts share a prefill call (0: none,
    hold_admissions); request_chunk: prompt tokens one request prefills a step at most (0: the
    step's prefill_chunk; EngineConfig.graph_chunk)."""

    budget: int
    capacity: int
    prefill_chunk: int
    slack: int = 0
    buckets: tuple[int, ...] = ()
    packed: bool = False
    prefill_wait: int = 0
    request_chunk: int = 0


def _take(left: int, budget: int, request_chunk: int) -> int:
    """Prompt tokens a request with `left` to prefill gets of the step's `budget` left, at most
    `request_chunk` (0: no bound of its own)."""
    take = min(left, budget)
    return min(take, request_chunk) if request_chunk else take


@dataclass
class Fit:
    """What the budget allows this step: the rows per slot to ensure, whether the decode call is
    padded to its bucket, the slots whose requests are preempted (newest first), and whether the
    padded call had to run eagerly instead."""

    rows: dict[int, int]
    padded: bool
    victims: list[int] = field(default_factory=list)
    eager_fallback: bool = False


# The rules below run every step over every slot (64 and more): Running.decoding is spelled
# out inline there (length - cached == 1), a property call per slot being most of their cost.


def decode_span(slots: Sequence[Running | None], padded: bool, limits: Limits):
    """The decode call's slot range [lo, hi) (None without a decoding request)."""
    decoding = [s for s, r in enumerate(slots) if r is not None and r.length - r.cached == 1]
    return decode_range(decoding, limits.buckets if padded else ())


def _prefilling(slots: Sequence[Running | None]) -> list[tuple[int, Running]]:
    """(slot, request) of the prefilling requests, oldest first."""
    out = [(s, r) for s, r in enumerate(slots) if r is not None and r.length - r.cached != 1]
    if len(out) > 1:
        out.sort(key=lambda sr: sr[1].arrival)
    return out


def prefill_chunks(
    slots: Sequence[Running | None], chunk: int, request_chunk: int = 0
) -> list[tuple[int, int]]:
    """(slot, tokens) of this step's prefill calls: the prefilling requests, oldest first, until
    `chunk` tokens were given out (a request past the budget gets nothing this step), each at
    most `request_chunk` (0: no bound but the step's)."""
    out = []
    for s, r in _prefilling(slots):
        if chunk <= 0:
            break
        take = _take(r.length - r.cached, chunk, request_chunk)
        chunk -= take
        out.append((s, take))
    return out


def next_prefill_rows(
    slots: Sequence[Running | None], chunks: Sequence[tuple[int, int]], limits: Limits
) -> dict[int, int]:
    """The rows the next step's prefill chunks write up to (their read slack included), were
    this step's `chunks` ((slot, tokens)) done and nothing else changed: what the cache may
    commit while this step's calls run. A prompt this step completes decodes next (not here);
    requests admitted or preempted next step may change the order, and then the rows committed
    ahead wait for their request's own chunk."""
    after = list(slots)
    for s, take in chunks:
        r = after[s]
        after[s] = r._replace(cached=r.cached + take)
    rows: dict[int, int] = {}
    for s, take in prefill_chunks(after, limits.prefill_chunk, limits.request_chunk):
        if take:
            rows[s] = min(after[s].cached + take + limits.slack, limits.capacity)
    return rows


def step_rows(slots: Sequence[Running | None], limits: Limits, padded: bool) -> dict[int, int]:
    """Rows per slot this step writes up to (scratch rows too), the decode call padded or not."""
    rows: dict[int, int] = {}
    prefilled: list[int] = []
    budget = limits.prefill_chunk
    for s, r in _prefilling(slots):
        take = _take(r.length - r.cached, budget, limits.request_chunk)
        budget -= take
        rows[s] = min(r.cached + max(take, 1) + (limits.slack if take else 0), limits.capacity)
        if take:
            prefilled.append(s)
    if limits.packed and limits.slack and prefilled:
        scratch = min(1 + limits.slack, limits.capacity)
        for s in range(min(prefilled), max(prefilled) + 1):
            if slots[s] is None:
                rows[s] = scratch
    span = decode_span(slots, padded, limits)
    if span is not None:
        get = rows.get
        for s in range(*span):
            r = slots[s]
            n = r.cached + 1 if r is not None else 1
            held = get(s)
            rows[s] = n if held is None or n > held else held
    return rows


def need_bytes(rows: dict[int, int], held: Sequence[int], commit_bytes: CommitBytes) -> int:
    """KV bytes committed once `rows` are ensured: every slot's rows, at least what it holds
    already (ensure never shrinks), a granule that neighbouring slots share counted once
    (commit_bytes counts the union; a sum per slot would count a 2 MiB CUDA granule once per
    slot it holds and refuse requests that fit)."""
    tokens = [0] * len(held)
    for s, n in rows.items():
        tokens[s] = max(n, held[s])
    return commit_bytes(tokens)


def admissions(
    slots: Sequence[Running | None],
    waiting: Sequence[tuple[int, int]],
    held: Sequence[int],
    limits: Limits,
    commit_bytes: CommitBytes,
) -> list[int]:
    """The slots the first waiting requests ((arrival, length), oldest first) take, in order:
    each the lowest free slot, while the step's rows with its whole sequence fit the budget."""
    view = list(slots)
    taken: list[int] = []
    for arrival, length in waiting:
        if None not in view:
            break
        slot = view.index(None)
        rows = step_rows(view, limits, padded=bool(limits.buckets))
        rows[slot] = max(rows.get(slot, 0), length)
        running = any(r is not None for r in view)
        if running and need_bytes(rows, held, commit_bytes) > limits.budget:
            break
        view[slot] = Running(arrival, 0, length)
        taken.append(slot)
    return taken


def hold_admissions(
    slots: Sequence[Running | None],
    waiting: Sequence[tuple[int, int]],
    limits: Limits,
    waited: int,
) -> bool:
    """Whether this step admits nobody (`waited`: the steps held so far), so that the prompts
    waiting ((arrival, length), oldest first) start together, a few steps later, in one prefill
    call rather than in a call each: a step that prefills is an eager call whose kernel
    launches cost the host milliseconds however few its tokens (docs/SERVING.md, "Prefill
    held for company"). Held only while requests decode, none prefills (else a prefill call
    runs this step anyway), a slot is free, fewer than `limits.prefill_wait` steps were held,
    and the prompts that the free slots would take hold fewer than a chunk's tokens and fill
    fewer than an eighth of the slots (at least one)."""
    if waited >= limits.prefill_wait or not waiting:
        return False
    free = 0
    decoding = False
    for r in slots:
        if r is None:
            free += 1
        elif r.length - r.cached == 1:
            decoding = True
        else:
            return False  # a prompt is prefilling: this step's prefill call runs anyway
    if not decoding or not free:
        return False
    company = waiting[:free]
    if len(company) >= max(1, len(slots) // 8):
        return False
    return sum(length for _, length in company) < limits.prefill_chunk


def keep_scratch(
    rows: dict[int, int],
    held: Sequence[int],
    free: Sequence[int],
    limits: Limits,
    commit_bytes: CommitBytes,
) -> bool:
    """Whether the free slots `free` keep what they hold (a freed slot's row-0 granule) beside
    this step's `rows` within the budget, which fit_budget counted without them: while
    admissions are held (hold_admissions), the requests held take those slots soon."""
    kept = dict(rows)
    for s in free:
        kept[s] = held[s]
    return need_bytes(kept, held, commit_bytes) <= limits.budget


def fit_budget(
    slots: Sequence[Running | None],
    held: Sequence[int],
    limits: Limits,
    commit_bytes: CommitBytes,
) -> Fit:
    """This step's rows under the budget (see the module docstring): padded if its scratch rows
    fit, else the decoding span eagerly, else newest requests preempted until the rest fits (a
    request alone always runs)."""
    view, held = list(slots), list(held)
    victims: list[int] = []
    while True:
        running = [s for s, r in enumerate(view) if r is not None]
        if limits.buckets:
            rows = step_rows(view, limits, padded=True)
            if need_bytes(rows, held, commit_bytes) <= limits.budget:
                return Fit(rows, True, victims)
        rows = step_rows(view, limits, padded=False)
        if need_bytes(rows, held, commit_bytes) <= limits.budget or len(running) <= 1:
            fallback = bool(limits.buckets) and decode_span(view, False, limits) is not None
            return Fit(rows, False, victims, fallback)
        victim = max(running, key=lambda s: view[s].arrival)
        view[victim] = None
        held[victim] = min(held[victim], 1)  # the engine releases it keeping row 0
        victims.append(victim)


@dataclass
class StepPlan:
    """One step's decisions (plan_step): whether admissions are held, the slots the first
    waiting requests take (in their order), the budget's fit (rows, padding, the slots whose
    requests are preempted), and on the slots as they are then (`view`), the decode call's
    span and the prefill chunks ((slot, tokens))."""

    held: bool
    admitted: list[int]
    fit: Fit
    view: list[Running | None]
    span: tuple[int, int] | None
    chunks: list[tuple[int, int]]


def plan_step(
    slots: Sequence[Running | None],
    waiting: Sequence[tuple[int, int]],
    held: Sequence[int],
    limits: Limits,
    commit_bytes: CommitBytes,
    waited: int = 0,
) -> StepPlan:
    """The step of these slots and waiting requests ((arrival, length), oldest first): admissions
    held (hold_admissions, `waited` steps so far) or given (admissions), the admitted requests
    placed with nothing cached, the budget's fit (fit_budget) and its victims' slots emptied,
    then the decode span and the prefill chunks of what runs."""
    view = list(slots)
    hold, admitted = False, []
    if waiting and None in view:
        hold = hold_admissions(view, waiting, limits, waited)
        if not hold:
            admitted = admissions(view, waiting, held, limits, commit_bytes)
            for slot, (arrival, length) in zip(admitted, waiting):
                view[slot] = Running(arrival, 0, length)
    fit = fit_budget(view, held, limits, commit_bytes)
    for slot in fit.victims:
        view[slot] = None
    span = decode_span(view, fit.padded, limits)
    chunks = prefill_chunks(view, limits.prefill_chunk, limits.request_chunk)
    return StepPlan(hold, admitted, fit, view, span, chunks)
