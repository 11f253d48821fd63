"""EngineReplica.generate without Ray: the first event alone, later ones gathered for
stream_interval seconds, the last one sent when it comes, and a caller that stops reading
cancels the request. A stand-in engine emits events from its own thread, as the engine does."""

from __future__ import annotations

import asyncio
import threading
import time

from ort_kvlayout.serve.cluster.replica import EngineReplica
from ort_kvlayout.serve.engine import Event, RequestParams


class FakeHandle:
    def __init__(self):
        self.finish_reason = None
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()


class FakeEngine:
    """submit() starts a thread that emits n events `gap` seconds apart, the last finished."""

    def __init__(self, n: int, gap: float):
        self.n, self.gap = n, gap
        self.handle = FakeHandle()

    def close(self, drain=False):  # the replica's __del__
        pass

    def submit(self, prompt, params, on_event):
        def run():
            for i in range(self.n):
                if self.handle.cancelled.is_set():
                    return
                last = i == self.n - 1
                if last:
                    self.handle.finish_reason = "length"
                on_event(Event(1, 10 + i, None, "length" if last else None, len(prompt), i + 1))
                time.sleep(self.gap)

        threading.Thread(target=run, daemon=True).start()
        return self.handle


def replica(engine: FakeEngine, interval: float) -> EngineReplica:
    r = EngineReplica.__new__(EngineReplica)  # the model-loading constructor skipped
    r.engine, r.stream_interval = engine, interval
    return r


def collect(r: EngineReplica, stop_after: int | None = None) -> list[list[Event]]:
    async def main():
        batches = []
        gen = r.generate([1, 2, 3], RequestParams(max_tokens=10))
        async for batch in gen:
            batches.append(batch)
            if stop_after is not None and len(batches) == stop_after:
                await gen.aclose()  # the caller went away
                break
        return batches

    return asyncio.run(main())


def test_first_event_alone_then_gathered_and_the_last_at_once():
    engine = FakeEngine(10, 0.005)
    start = time.monotonic()
    batches = collect(replica(engine, interval=5.0))
    elapsed = time.monotonic() - start
    assert [len(b) for b in batches] == [1, 9]
    assert [e.token_id for b in batches for e in b] == list(range(10, 20))
    assert batches[-1][-1].finish_reason == "length"
    assert elapsed < 4.0  # the finished event cut the 5 s gathering short


def test_interval_zero_sends_what_is_there():
    batches = collect(replica(FakeEngine(6, 0.02), interval=0.0))
    assert [e.token_id for b in batches for e in b] == list(range(10, 16))
    assert len(batches) > 2  # no gathering: events 20 ms apart go out as they come


def test_a_caller_that_stops_reading_cancels_the_request():
    engine = FakeEngine(1000, 0.002)
    batches = collect(replica(engine, interval=0.0), stop_after=2)
    assert len(batches) == 2
    assert engine.handle.cancelled.wait(5)
