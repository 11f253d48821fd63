"""A replica's message to the ingress: one request's events, in columns.

    pack_events(events) -> tuple      # on the replica, a list per message (replica.py)
    unpack_events(packed) -> events   # on the ingress (client.py)

Ray pickles each message with cloudpickle in the replica, whose GIL the engine thread needs:
40 frozen Event dataclasses took about 69 us there, their columns (lists of ints and strings)
about 1 us. A message holds one request's events, and only its last can end the request."""

from __future__ import annotations

from ..requests import Event

__all__ = ["pack_events", "unpack_events"]


def pack_events(events: list[Event]) -> tuple:
    """(request_id, prompt_tokens, token_ids, texts, completion_tokens, finish_reason, error)
    of a non-empty list of one request's events, of which only the last may be finished."""
    if not events:
        raise ValueError("a message needs at least one event")
    first, last = events[0], events[-1]
    for e in events:
        if e.request_id != first.request_id or e.prompt_tokens != first.prompt_tokens:
            raise ValueError(
                f"a message holds one request's events: request {e.request_id} among "
                f"request {first.request_id}'s"
            )
    if any(e.finished or e.error is not None for e in events[:-1]):
        raise ValueError(f"request {first.request_id}: an event after its last one")
    return (
        first.request_id,
        first.prompt_tokens,
        [e.token_id for e in events],
        [e.text for e in events],
        [e.completion_tokens for e in events],
        last.finish_reason,
        last.error,
    )


def unpack_events(packed: tuple) -> list[Event]:
    """The events pack_events took."""
    rid, prompt_tokens, tokens, texts, completions, reason, error = packed
    events = [
        Event(rid, token, text, None, prompt_tokens, completion)
        for token, text, completion in zip(tokens, texts, completions)
    ]
    if reason is not None or error is not None:  # the last event ends the request
        last = events[-1]
        events[-1] = Event(rid, last.token_id, last.text, reason, prompt_tokens,
                           last.completion_tokens, error)  # fmt: skip
    return events
