"""server.build_app over an engine other than the local Engine (what serve/cluster's ingress
serves): a coroutine submit, a handle whose replica is lost mid-stream (finish_reason "abort"
and an error frame, or 503 before the response starts), and /metrics labelled by replica.
Driven as a bare ASGI app, without Ray."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("starlette")

from ort_kvlayout.serve.engine import EngineClosed, EngineOverloaded, Event
from ort_kvlayout.serve.server import build_app
from serve_util import asgi_request


class LostHandle:
    """Yields `tokens` then raises EngineClosed (its replica went away) if `lost`."""

    def __init__(self, tokens: list[int], lost: bool):
        self.script, self.lost = tokens, lost
        self.tokens: list[int] = []
        self.finish_reason = None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self):
        for i, t in enumerate(self.script):
            self.tokens.append(t)
            last = i == len(self.script) - 1 and not self.lost
            if last:
                self.finish_reason = "length"
            yield Event(1, t, None, "length" if last else None, 3, i + 1)
        if self.lost:
            raise EngineClosed("the replica serving this request was lost (ActorDiedError)")


class RemoteLikeEngine:
    capacity = 64
    closing = False

    def __init__(self, lost: bool = False, refuse: Exception | None = None):
        self.lost, self.refuse = lost, refuse
        self.handles: list[LostHandle] = []

    async def submit(self, prompt, params):
        await asyncio.sleep(0)
        if self.refuse is not None:
            raise self.refuse
        self.handles.append(LostHandle([5, 6, 7], self.lost))
        return self.handles[-1]

    def replica_stats(self) -> dict[str, dict]:
        return {
            "b2": {"running": 1, "waiting": 0, "tokens": 7, "pid": 22, "host": "h"},
            "a1": {"running": 2, "waiting": 3, "tokens": 9, "pid": 11, "host": "h"},
        }


class BatchedHandle(LostHandle):
    """Its events come in lists, like a cluster replica's: `ready` counts those in hand."""

    def __init__(self, batches: list[list[int]]):
        super().__init__([t for b in batches for t in b], lost=False)
        self.batches = batches
        self.ready = 0

    async def __aiter__(self):
        done = 0
        for batch in self.batches:
            self.ready = len(batch)
            for _ in batch:
                self.ready -= 1
                done += 1
                t = self.script[done - 1]
                self.tokens.append(t)
                last = done == len(self.script)
                if last:
                    self.finish_reason = "length"
                yield Event(1, t, None, "length" if last else None, 3, done)


def messages(app, path: str, body: dict) -> list[bytes]:
    """The response's body messages, as the server sent them."""
    sent = []
    bodies = [json.dumps(body).encode()]

    async def receive():
        if bodies:
            return {"type": "http.request", "body": bodies.pop(), "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "method": "POST", "path": path, "headers": [], "query_string": b"",
        "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "root_path": "",
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    return [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]


def test_a_list_of_events_is_one_write():
    engine = RemoteLikeEngine()

    async def submit(prompt, params):
        return BatchedHandle([[5], [6, 7, 8], [9, 10]])

    engine.submit = submit
    out = messages(build_app(engine, "m"), "/v1/completions", BODY)
    # [5]; [6, 7, 8]; [9, 10] and the finish chunk; [DONE]: one write each.
    assert [m.count(b"data: ") for m in out] == [1, 3, 3, 1]
    assert [f["choices"][0]["token_ids"] for f in frames(b"".join(out))[:6]] == [
        [5], [6], [7], [8], [9], [10]
    ]  # fmt: skip


def call(app, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    raw = json.dumps(body).encode() if body is not None else b""
    return asyncio.run(asgi_request(app, method, path, raw))


def frames(raw: bytes) -> list:
    out = []
    for frame in raw.decode().split("\n\n"):
        if frame:
            data = frame.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True}


def test_stream_through_a_coroutine_submit():
    engine = RemoteLikeEngine()
    status, raw = call(build_app(engine, "m"), "POST", "/v1/completions", BODY)
    got = frames(raw)
    assert status == 200
    assert [f["choices"][0]["token_ids"] for f in got[:3]] == [[5], [6], [7]]
    assert got[-2]["choices"][0]["finish_reason"] == "length" and got[-1] == "[DONE]"


def test_replica_lost_mid_stream_aborts_with_an_error():
    engine = RemoteLikeEngine(lost=True)
    body = {**BODY, "stream_options": {"include_usage": True}}
    status, raw = call(build_app(engine, "m"), "POST", "/v1/completions", body)
    got = frames(raw)
    assert status == 200
    assert [f["choices"][0]["token_ids"] for f in got[:3]] == [[5], [6], [7]]
    assert got[3]["choices"][0]["finish_reason"] == "abort"
    assert got[4]["error"]["type"] == "server_error" and "lost" in got[4]["error"]["message"]
    assert got[5:] == ["[DONE]"]  # no usage: the counts stopped with the replica
    assert engine.handles[0].cancelled  # the server let go of it


def test_replica_lost_answers_503_without_a_stream():
    engine = RemoteLikeEngine(lost=True)
    status, raw = call(build_app(engine, "m"), "POST", "/v1/completions", {**BODY, "stream": False})
    assert status == 503 and "lost" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize(
    ("refuse", "status"),
    [
        (EngineOverloaded("3 requests are waiting (limit 2)"), 503),
        (EngineClosed("the engine is shutting down"), 503),
        (ValueError("token ids [999] outside the vocabulary"), 400),
        (KeyError("boom"), 500),
    ],
)
def test_refusals_before_the_response(refuse, status):
    engine = RemoteLikeEngine(refuse=refuse)
    got, raw = call(build_app(engine, "m"), "POST", "/v1/completions", BODY)
    assert got == status
    assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}


def test_metrics_one_series_per_replica():
    status, raw = call(build_app(RemoteLikeEngine(), "m"), "GET", "/metrics")
    text = raw.decode()
    assert status == 200
    assert 'ort_kvlayout_requests_waiting{model="m",replica="a1"} 3' in text
    assert 'ort_kvlayout_requests_waiting{model="m",replica="b2"} 0' in text
    assert 'ort_kvlayout_generation_tokens_total{model="m",replica="a1"} 9' in text
    assert 'ort_kvlayout_replicas{model="m"} 2' in text
    assert 'ort_kvlayout_replica_info{model="m",replica="a1",pid="11",host="h"} 1' in text
    assert text.count("# TYPE ort_kvlayout_requests_waiting gauge") == 1
