"""What a request is and what comes back: RequestParams, the Event stream read through a
RequestHandle, and the errors submit raises (serve/engine.py makes and feeds them)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral

from ..runtime.sampling import GREEDY, SamplingParams

__all__ = [
    "EngineClosed",
    "EngineOverloaded",
    "Event",
    "RequestHandle",
    "RequestParams",
    "RequestTooLarge",
    "put_all",
]


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (a server answers 503)."""


class RequestTooLarge(ValueError):
    """The prompt plus max_tokens cannot fit the context, the cache or the KV budget (413)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down or closed."""


@dataclass(frozen=True)
class RequestParams:
    """max_tokens: tokens to generate at most; stop_token_ids: extra ids that end the request
    (the model's EOS ids end it unless ignore_eos); stop: strings that end it (needs a
    tokenizer; the text is cut before the stop string)."""

    max_tokens: int = 16
    sampling: SamplingParams = GREEDY
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, Integral):
            raise TypeError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {self.sampling!r}")
        if isinstance(self.stop, str):  # one string, as OpenAI's `stop` takes it: not its letters
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) for s in self.stop):
            raise TypeError(f"stop must hold strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        ids = self.stop_token_ids
        if isinstance(ids, Integral) or any(
            isinstance(t, bool) or not isinstance(t, Integral) for t in ids
        ):
            raise TypeError(f"stop_token_ids must be a sequence of integers, got {ids!r}")


@dataclass(frozen=True)
class Event:
    """One step's output of a request: a token (None on a final event without one), the text it
    adds (None without a tokenizer), and on the last event finish_reason: "stop" (EOS, a stop
    id or string), "length" (max_tokens), "cancelled" or "error" (error says why)."""

    request_id: int
    token_id: int | None
    text: str | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def put_all(items: list[tuple[RequestHandle, Event]]) -> None:
    """On a reader's event loop: one step's events for its handles (one wake-up a step)."""
    for handle, event in items:
        handle._arrive(event)


class RequestHandle:
    """What submit returns: iterate it (blocking) or `async for` it (the loop it was submitted
    from) to receive its events; cancel() ends it and frees its slot at the next step."""

    def __init__(
        self, cancel: Callable[[int], None], request_id: int,
        loop: asyncio.AbstractEventLoop | None,
    ):  # fmt: skip
        self.id = request_id
        self._cancel = cancel  # the engine's cancel
        self._loop = loop
        self._sync: queue.SimpleQueue = queue.SimpleQueue()
        self._async: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        # set on the loop once the last event is queued (wait_end)
        self._ended: asyncio.Event | None = asyncio.Event() if loop is not None else None
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._callback = False  # submitted with on_event: its events go to the callback
        self._done = threading.Event()  # set by the last event

    def _push(self, event: Event) -> None:  # the engine thread
        if self._async is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._arrive, event)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass
        else:
            self._sync.put(event)

    def _arrive(self, event: Event) -> None:  # the reader's loop
        self._async.put_nowait(event)
        if event.finished:
            self._ended.set()

    def cancel(self) -> None:
        self._cancel(self.id)

    def _take(self, event: Event) -> Event:
        if event.token_id is not None:
            self.tokens.append(event.token_id)
        if event.finished:
            self.finish_reason = event.finish_reason
            self._done.set()
        return event

    def __iter__(self):
        if self._async is not None:
            raise TypeError("a request submitted from an event loop is read with `async for`")
        if self._callback:
            raise TypeError(
                "a request submitted with on_event is read through its callback; result() "
                "waits for its end"
            )
        while self.finish_reason is None:
            yield self._take(self._sync.get())

    async def __aiter__(self):
        self._check_async()
        while self.finish_reason is None:
            yield self._take(await self._async.get())

    # A reader that forwards events in batches (a Ray Serve replica sends a list per message):
    # next_event, then wait_end for the rest of an interval, then take_ready.
    async def next_event(self) -> Event:
        """The next event (waiting for it); after the last one, raises StopAsyncIteration."""
        self._check_async()
        if self.finish_reason is not None:
            raise StopAsyncIteration
        return self._take(await self._async.get())

    async def wait_end(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the last event to arrive (not read); True if it
        did."""
        self._check_async()
        if self._ended.is_set():
            return True
        try:
            await asyncio.wait_for(self._ended.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def take_ready(self) -> list[Event]:
        """The events that arrived and were not read yet, read now (without waiting)."""
        self._check_async()
        events = []
        while self.finish_reason is None and not self._async.empty():
            events.append(self._take(self._async.get_nowait()))
        return events

    def _check_async(self) -> None:
        if self._async is None:
            raise TypeError("submit from a running event loop to read with `async for`")

    def result(self) -> list[int]:
        """Blocks until the request ends; its generated tokens."""
        if self._callback:  # the events went to the callback; the handle keeps the tokens
            self._done.wait()
            return self.tokens
        for _ in self:
            pass
        return self.tokens
