"""The engine's event hand-over (ort_kvlayout.serve.publisher) alone: no model or engine. A
step's stats are shown before its events reach their readers, in order; text queued as LATER
is decoded at the hand-over; a raising reader or tokenizer is its request's problem alone; with
`overlapped`, a thread of its own hands the steps over, one at a time, and close() waits for it."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from ort_kvlayout.serve.publisher import LATER, Publisher
from ort_kvlayout.serve.requests import RequestHandle


class Profile:
    def __init__(self):
        self.phases = Counter()

    def add(self, phase: str, t: int) -> int:
        self.phases[phase] += 1
        return t


class Text:
    """An incremental decoder of ids: ' <id>' a token; raises from token `fail_at` on."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.done = 0

    def delta(self, seq, final=False, upto=None):
        upto = len(seq) if upto is None else upto
        if self.fail_at is not None and upto > self.fail_at:
            raise ValueError("bad bytes")
        out, self.done = "".join(f" {t}" for t in seq[self.done : upto]), upto
        return out, False


@dataclass(eq=False)
class Request:
    id: int
    text: Text | None = None
    seq: list[int] = field(default_factory=list)
    generated: int = 0
    prompt_len: int = 2

    def __post_init__(self):
        self.handle = RequestHandle(lambda _id: None, self.id, None)

    def emit(self, publisher: Publisher, token: int, reason: str | None = None) -> None:
        self.seq.append(token)
        self.generated += 1
        publisher.deliver(self, token, LATER if self.text else None, reason)


def make(overlapped: bool = False):
    shown, posts, counters = [], [], Counter()
    publisher = Publisher(
        overlapped, Profile(), counters, lambda kind, item: posts.append((kind, item)),
        shown.append,
    )  # fmt: skip
    return publisher, shown, posts, counters


def drain(r: Request) -> list:
    events = []
    while not r.handle._sync.empty():
        events.append(r.handle._take(r.handle._sync.get()))
    return events


def test_stats_first_then_the_events_in_order_with_their_text():
    publisher, shown, _, _ = make()
    a, b = Request(1, Text()), Request(2)
    seen = []
    push = a.handle._push
    a.handle._push = lambda event: (seen.append(list(shown)), push(event))
    a.emit(publisher, 7)
    b.emit(publisher, 8)
    a.emit(publisher, 9, "length")
    assert drain(a) == [] and shown == []  # queued: nothing handed over before publish
    publisher.publish({"step": 1})
    assert seen[0] == [{"step": 1}]  # the reader saw the step's stats before its event
    events = drain(a)
    assert [(e.token_id, e.text, e.finish_reason) for e in events] == [
        (7, " 7", None), (9, " 9", "length")
    ]  # fmt: skip
    assert [e.token_id for e in drain(b)] == [8] and a.handle.finish_reason == "length"


def test_a_raising_reader_is_cancelled_alone_and_its_end_still_recorded():
    publisher, _, posts, counters = make()
    bad, good = Request(1), Request(2)

    def raising(event):
        raise RuntimeError("the reader's bug")

    bad.handle._push = raising
    bad.emit(publisher, 5)
    good.emit(publisher, 6)
    bad.emit(publisher, 7)  # dropped: its request is being cancelled
    publisher.publish({})
    assert posts == [("cancel", 1)] and counters["callback_errors"] == 1
    assert [e.token_id for e in drain(good)] == [6]
    bad.emit(publisher, 8, "cancelled")  # its end: recorded without calling the reader again
    publisher.publish({})
    assert bad.handle.finish_reason == "cancelled" and counters["callback_errors"] == 1


def test_a_failing_tokenizer_fails_its_request_alone():
    publisher, _, posts, counters = make()
    broken, fine = Request(1, Text(fail_at=1)), Request(2, Text())
    broken.emit(publisher, 3)
    broken.emit(publisher, 4)
    fine.emit(publisher, 5)
    publisher.publish({})
    assert posts == [("fail", (1, "decoding the text failed: ValueError: bad bytes"))]
    assert counters["detokenize_errors"] == 1  # once: its later events carry no text
    assert [(e.token_id, e.text) for e in drain(broken)] == [(3, " 3"), (4, None)]
    assert [(e.token_id, e.text) for e in drain(fine)] == [(5, " 5")]


def test_overlapped_steps_are_handed_over_on_a_thread_of_their_own_in_order():
    publisher, shown, _, _ = make(overlapped=True)
    publisher.start()
    r = Request(1, Text())
    threads = []
    push = r.handle._push
    r.handle._push = lambda event: (threads.append(threading.current_thread().name), push(event))
    for step in range(20):
        r.emit(publisher, step, "length" if step == 19 else None)
        publisher.publish({"step": step})
    publisher.close(timeout=30)
    assert publisher.thread is None
    assert shown == [{"step": s} for s in range(20)]
    assert set(threads) == {"ort-kvlayout-publisher"}
    events = drain(r)
    assert [e.token_id for e in events] == list(range(20))
    assert "".join(e.text for e in events) == "".join(f" {s}" for s in range(20))
