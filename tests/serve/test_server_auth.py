"""The API key: every /v1/* route answers 401 without it (OpenAI's error shape), /health stays
open, /metrics is open or keyed by choice; the key comes from --api-key or the environment;
binding beyond loopback without a key warns. The middleware is checked on a bare ASGI app, the
whole path through a real `ort-kvlayout serve` process."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from ort_kvlayout.serve.auth import API_KEY_ENV, RequireApiKey, exposed_without_key
from ort_kvlayout.serve.cli import build_parser, resolve_api_key, warn_if_exposed
from serve_util import ServerProcess, library_or_skip, make_served_model

KEY = "sk-test-0123456789"


async def _echo(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def call(app, path: str, headers: list[tuple[bytes, bytes]] = ()) -> tuple[int, dict, bytes]:
    """One GET through an ASGI app: (status, headers, body)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": list(headers)}
    asyncio.run(app(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


def test_middleware_guards_v1_only():
    app = RequireApiKey(_echo, KEY)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/x", "/v1"):
        status, headers, body = call(app, path)
        assert status == 401, path
        assert headers[b"www-authenticate"] == b"Bearer"
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert "Missing API key" in error["message"]
        status, _, body = call(app, path, bearer("sk-wrong"))
        assert status == 401 and "Incorrect API key" in json.loads(body)["error"]["message"]
        assert call(app, path, bearer(KEY))[0] == 200
    assert call(app, "/health")[0] == 200
    assert call(app, "/metrics")[0] == 200
    assert call(app, "/v1x")[0] == 200  # not an OpenAI route: the app answers (404 in the server)


def test_middleware_header_forms():
    app = RequireApiKey(_echo, KEY)
    assert call(app, "/v1/models", [(b"Authorization", f"bearer  {KEY} ".encode())])[0] == 200
    assert call(app, "/v1/models", [(b"authorization", KEY.encode())])[0] == 401  # no scheme
    assert call(app, "/v1/models", [(b"authorization", f"Basic {KEY}".encode())])[0] == 401
    assert call(app, "/v1/models", [(b"authorization", b"Bearer ")])[0] == 401
    assert call(app, "/v1/models", bearer(KEY + "x"))[0] == 401
    assert call(app, "/v1/models", bearer(KEY[:-1]))[0] == 401


def test_middleware_metrics_by_choice():
    app = RequireApiKey(_echo, KEY, metrics=True)
    assert call(app, "/metrics")[0] == 401
    assert call(app, "/metrics", bearer(KEY))[0] == 200
    assert call(app, "/health")[0] == 200
    with pytest.raises(ValueError, match="empty"):
        RequireApiKey(_echo, "")


def test_key_from_argument_or_environment(monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(parse(["serve", "m"])) is None
    assert resolve_api_key(parse(["serve", "m", "--api-key", "a"])) == "a"
    with pytest.raises(ValueError, match="--api-key is empty"):
        resolve_api_key(parse(["serve", "m", "--api-key", " "]))
    with pytest.raises(ValueError, match="--metrics-auth needs a key"):
        resolve_api_key(parse(["serve", "m", "--metrics-auth"]))
    monkeypatch.setenv(API_KEY_ENV, "b")
    assert resolve_api_key(parse(["serve", "m"])) == "b"
    assert resolve_api_key(parse(["serve", "m", "--api-key", "a"])) == "a"  # the flag wins
    assert resolve_api_key(parse(["serve", "m", "--metrics-auth"])) == "b"
    monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(ValueError, match="set but empty"):
        resolve_api_key(parse(["serve", "m"]))
    assert isinstance(parse(["serve", "m"]), argparse.Namespace)


def test_exposed_without_key():
    for host in ("0.0.0.0", "::", "[::]", "10.1.2.3", "example.org"):
        assert exposed_without_key(host, None), host
        assert not exposed_without_key(host, KEY), host
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "[::1]"):
        assert not exposed_without_key(host, None), host


def test_warning_when_exposed_without_key(capsys):
    warn_if_exposed("0.0.0.0", None)
    err = capsys.readouterr().err
    assert err.startswith("warning: serving on 0.0.0.0 without an API key")
    assert API_KEY_ENV in err
    warn_if_exposed("0.0.0.0", KEY)
    warn_if_exposed("127.0.0.1", None)
    assert capsys.readouterr().err == ""


def request(url: str, key: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"text": raw}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    library_or_skip()
    return make_served_model(tmp_path_factory.mktemp("auth"))


def test_server_requires_the_key_from_the_environment(model, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    proc = ServerProcess(model, "--model-id", "tiny", "--metrics-auth").wait_ready()
    try:
        assert KEY not in " ".join(proc.proc.args)  # nothing in `ps`
        completion = {"model": "tiny", "prompt": "abc", "max_tokens": 3}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        routes = [
            ("/v1/models", None), ("/v1/models/tiny", None), ("/v1/completions", completion),
            ("/v1/chat/completions", chat), ("/v1/completions", {**completion, "stream": True}),
            ("/v1/nowhere", None),
        ]  # fmt: skip
        for path, body in routes:
            for key in (None, "sk-wrong"):
                status, out = request(proc.url + path, key, body)
                assert status == 401, (path, key)
                assert out["error"]["code"] == "invalid_api_key"
        assert request(proc.url + "/v1/models", KEY)[1]["data"][0]["id"] == "tiny"
        status, out = request(proc.url + "/v1/completions", KEY, completion)
        assert status == 200 and out["usage"]["completion_tokens"] <= 3
        assert request(proc.url + "/v1/nowhere", KEY)[0] == 404
        assert request(proc.url + "/health") == (200, {"status": "ok"})
        assert request(proc.url + "/metrics")[0] == 401
        status, out = request(proc.url + "/metrics", KEY)
        assert status == 200 and "ort_kvlayout_requests_running" in out["text"]
    finally:
        code, _, err = proc.stop()
    assert code == 0 and "Traceback" not in err
    assert "without an API key" not in err


def test_server_metrics_open_by_default_and_bad_key_refused(model, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    proc = ServerProcess(model, "--api-key", KEY).wait_ready()
    try:
        assert request(proc.url + "/metrics")[0] == 200
        assert request(proc.url + "/v1/models")[0] == 401
    finally:
        code, _, err = proc.stop()
    assert code == 0, err
    monkeypatch.setenv(API_KEY_ENV, "")
    r = subprocess.run(
        [sys.executable, "-m", "ort_kvlayout.serve.cli", "serve", str(model)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith(f"error: ${API_KEY_ENV} is set but empty")
