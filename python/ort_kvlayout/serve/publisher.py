"""The engine's events on their way to the readers: a step's stats, then its events, in order.

    publisher = Publisher(overlapped, profile, counters, post, show)
    publisher.deliver(request, token, text, reason, error)  # the engine thread queues an event
    publisher.publish(snapshot)                              # after the step: stats, then events
    publisher.close()                                        # every event handed over

The engine thread queues each event of a step (`deliver`; text LATER: decoded when handed
over) and publishes them once the step's counters are taken (`publish`): the reader that sees
a request's last event also sees stats() without it. With `overlapped` (the CUDA default) a
thread of its own does the hand-over while the next step's calls run: it decodes the events'
text (incremental detokenization) and gives them to their readers, one `call_soon_threadsafe`
per event loop and step. It is at most one step behind: `publish` waits for the last hand-over
before it queues the next (`wait` in the step profile), so events never pile up behind a
starved thread. A reader's callback that raises, or a tokenizer that fails, is its request's
problem only: `post` asks the engine loop to cancel or fail that request at its next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

from .requests import Event, put_all

__all__ = ["LATER", "Publisher", "decode_failure"]

LATER = object()  # an event's text, decoded when the event is handed over
_log = logging.getLogger(__name__)


def decode_failure(exc: BaseException) -> str:
    """The error a request ends with when its tokenizer raised decoding its text."""
    return f"decoding the text failed: {type(exc).__name__}: {exc}"


class Publisher:
    """See the module docstring. `profile`: the executor's step profile (phases `publish` and
    `wait`); `counters`: the engine's (callback, detokenize and publish errors); `post(kind,
    item)`: a message to the engine loop's inbox ("cancel", id; "fail", (id, message));
    `show(snapshot)`: makes a step's stats the ones stats() returns."""

    def __init__(
        self,
        overlapped: bool,
        profile,
        counters: Counter,
        post: Callable[[str, object], None],
        show: Callable[[dict], None],
    ):
        self._profile = profile
        self._counters = counters
        self._post = post
        self._show = show
        self._outbox: list[tuple] = []  # this step's events (deliver)
        self._failed: set[int] = set()  # requests whose callback raised: events dropped
        self._broken: set[int] = set()  # requests whose text failed to decode: no text
        self._handoff: queue.SimpleQueue | None = queue.SimpleQueue() if overlapped else None
        self._handoff_free = threading.Semaphore(1)
        self.thread: threading.Thread | None = None

    @property
    def overlapped(self) -> bool:
        return self._handoff is not None

    def start(self) -> None:
        if self._handoff is not None and self.thread is None:
            self.thread = threading.Thread(
                target=self._loop, name="ort-kvlayout-publisher", daemon=True
            )
            self.thread.start()

    def deliver(
        self, r, token: int | None, text, reason: str | None = None, error: str | None = None
    ) -> None:
        """Queues an event for r's reader (text LATER: decoded when handed over, as of r's
        tokens now); `publish` hands it over."""
        self._outbox.append((r, token, text, reason, error, r.generated, len(r.seq)))

    def publish(self, snapshot: dict) -> None:
        """The step's stats, then its queued events: here, or on the publisher thread."""
        outbox, self._outbox = self._outbox, []
        if self._handoff is not None:
            t = time.perf_counter_ns()
            self._handoff_free.acquire()  # the last hand-over is done
            self._profile.add("wait", t)
            self._handoff.put((snapshot, outbox))
            return
        self._show(snapshot)
        self._flush(outbox)

    def flush(self) -> None:
        """The queued events handed over here and now (an engine closed before its loop ran)."""
        outbox, self._outbox = self._outbox, []
        self._flush(outbox)

    def close(self, timeout: float | None = None) -> None:
        """Every event published so far handed over, the thread ended."""
        if self.thread is not None:
            self._handoff.put(None)
            self.thread.join(timeout)
            self.thread = None

    def _loop(self) -> None:
        """The publisher thread (overlapped): each step's stats, then its events, in step order."""
        while (item := self._handoff.get()) is not None:
            snapshot, outbox = item
            self._show(snapshot)
            try:
                self._flush(outbox)
            except Exception:  # noqa: BLE001 -- a bug; the publisher must outlive it
                self._counters["publish_errors"] += 1
                _log.exception("ort-kvlayout engine: handing events over failed")
            finally:
                self._handoff_free.release()

    def _flush(self, outbox: list[tuple]) -> None:
        """Decodes the events' text and hands them over, in order; a callback that raises is
        that request's problem only: it is cancelled at the next step (its later events
        dropped), the other requests go on. On the engine thread, or on the publisher thread
        (which alone then touches the text of requests without stop strings, and _failed)."""
        if not outbox:
            return
        t = time.perf_counter_ns()
        loops: dict[asyncio.AbstractEventLoop, list] = {}  # async readers: one call per loop
        for r, token, text, reason, error, generated, upto in outbox:
            if r.id in self._failed:
                if reason is not None:  # its end, recorded without calling the callback again
                    self._failed.discard(r.id)
                    r.handle._take(Event(r.id, token, None, reason, r.prompt_len, generated, error))
                continue
            if text is LATER:
                text = self._decode_text(r, reason is not None, upto)
            if reason is not None:
                self._broken.discard(r.id)
            event = Event(r.id, token, text, reason, r.prompt_len, generated, error)
            handle = r.handle
            if handle._async is not None and handle._loop is not None:
                loops.setdefault(handle._loop, []).append((handle, event))
                continue
            try:
                handle._push(event)
            except Exception:  # noqa: BLE001 -- the caller's code, not the engine's
                self._counters["callback_errors"] += 1
                if reason is None:
                    self._failed.add(r.id)
                    self._post("cancel", r.id)  # the calls may be running: freed between steps
        for loop, items in loops.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass
        self._profile.add("publish", t)  # decoding, the readers' queues and callbacks

    def _decode_text(self, r, final: bool, upto: int) -> str | None:
        """r's new text as of token upto - 1; a tokenizer that raises ends r with an error (its
        events from then on carry no text), not the thread that hands events over."""
        if r.id in self._broken:
            return None
        try:
            return r.text.delta(r.seq, final=final, upto=upto)[0]
        except Exception as exc:  # noqa: BLE001 -- the tokenizer's code, one request's problem
            self._broken.add(r.id)
            self._counters["detokenize_errors"] += 1
            if not final:
                self._post("fail", (r.id, decode_failure(exc)))
            return None
