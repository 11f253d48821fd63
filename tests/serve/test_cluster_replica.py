"""EngineReplica.generate without Ray: the first event alone, later ones gathered for
stream_interval seconds, the last one sent when it comes, and a caller that stops reading
cancels the request. A stand-in engine emits events from its own thread onto the replica's
loop, as the engine does; the handle is the engine's own RequestHandle."""

from __future__ import annotations

import asyncio
import threading
import time

from ort_kvlayout.serve.cluster.replica import EngineReplica
from ort_kvlayout.serve.cluster.wire import pack_events, unpack_events
from ort_kvlayout.serve.engine import Event, RequestParams
from ort_kvlayout.serve.requests import RequestHandle, put_all


class FakeEngine:
    """submit() (from the replica's loop) returns a real RequestHandle and starts a thread that
    emits n events `gap` seconds apart, the last finished, each handed over onto the loop as the
    engine hands a step's events over (requests.put_all)."""

    def __init__(self, n: int, gap: float):
        self.n, self.gap = n, gap
        self.cancelled = threading.Event()
        self.handle = None

    def close(self, drain=False):  # the replica's __del__
        pass

    def submit(self, prompt, params):
        loop = asyncio.get_running_loop()
        self.handle = RequestHandle(lambda rid: self.cancelled.set(), 1, loop)

        def run():
            for i in range(self.n):
                if self.cancelled.is_set():
                    return
                last = i == self.n - 1
                event = Event(1, 10 + i, None, "length" if last else None, len(prompt), i + 1)
                loop.call_soon_threadsafe(put_all, [(self.handle, event)])
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
        async for message in gen:
            batches.append(unpack_events(message))
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
    assert engine.cancelled.wait(5)


def test_the_batched_reader_takes_what_arrived_and_stops_at_the_end():
    async def main():
        loop = asyncio.get_running_loop()
        handle = RequestHandle(lambda rid: None, 7, loop)
        assert handle.take_ready() == []
        assert not await handle.wait_end(0.01)  # nothing arrived: the timeout
        events = [Event(7, t, None, None, 3, t) for t in (1, 2)]
        events.append(Event(7, 3, None, "stop", 3, 3))
        put_all([(handle, e) for e in events])
        assert await handle.wait_end(5.0)  # the last arrived, unread
        assert (await handle.next_event()).token_id == 1
        assert [e.token_id for e in handle.take_ready()] == [2, 3]
        assert handle.tokens == [1, 2, 3] and handle.finish_reason == "stop"
        put_all([(handle, Event(7, 9, None, None, 3, 4))])  # nothing is read past the end
        assert handle.take_ready() == []
        try:
            await handle.next_event()
        except StopAsyncIteration:
            return
        raise AssertionError("next_event read past the request's last event")

    asyncio.run(main())


def test_a_handle_submitted_without_a_loop_refuses_the_batched_reader():
    handle = RequestHandle(lambda rid: None, 1, None)
    for read in (handle.take_ready, lambda: asyncio.run(handle.wait_end(0))):
        try:
            read()
        except TypeError as exc:
            assert "event loop" in str(exc)
        else:
            raise AssertionError("a blocking handle was read as an async one")


def test_a_message_carries_its_events_exactly_and_refuses_mixed_ones():
    events = [Event(4, 10 + i, f"t{i}", None, 7, i + 1) for i in range(3)]
    events.append(Event(4, None, "", "error", 7, 3, "the tokenizer failed"))
    assert unpack_events(pack_events(events)) == events
    one = [Event(4, 9, None, "length", 7, 1)]
    assert unpack_events(pack_events(one)) == one
    bad = [
        [],
        [Event(4, 1, None), Event(5, 2, None)],  # two requests
        [Event(4, 1, None, "stop", 7, 1), Event(4, 2, None, None, 7, 2)],  # past the end
    ]
    for events in bad:
        try:
            pack_events(events)
        except ValueError:
            continue
        raise AssertionError(f"packed {events}")
