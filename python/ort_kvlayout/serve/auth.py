"""Who may call the server: a bearer key on the OpenAI routes, as OpenAI's API and vLLM's
`--api-key` ask for it.

    app = RequireApiKey(app, key="s3cret")               # every /v1/* route needs the key
    app = RequireApiKey(app, key="s3cret", metrics=True)  # /metrics too

A request to a protected path without `Authorization: Bearer KEY`, or with another key, gets
401 with an OpenAI-style error body and `WWW-Authenticate: Bearer`. /health stays open (load
balancers and orchestrators probe it without credentials). Keys are compared as SHA-256
digests with `hmac.compare_digest`: the time taken says nothing about the key, its length
included.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json

__all__ = ["API_KEY_ENV", "RequireApiKey", "exposed_without_key", "key_digest", "protected_path"]

API_KEY_ENV = "ORT_KVLAYOUT_API_KEY"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def key_digest(key: str) -> bytes:
    """The SHA-256 digest RequireApiKey compares with: what a process that must check the key
    but not hold it (a cluster's ingress) is given."""
    if not key:
        raise ValueError("the API key is empty")
    return _digest(key.encode())


def protected_path(path: str, metrics: bool) -> bool:
    """Whether a request to `path` needs the key: the OpenAI routes, and /metrics if asked."""
    return path == "/v1" or path.startswith("/v1/") or (metrics and path == "/metrics")


def _unauthorized(message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    error = {"message": message, "type": "invalid_request_error", "param": None,
             "code": "invalid_api_key"}  # fmt: skip
    body = json.dumps({"error": error}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    return body, headers


class RequireApiKey:
    """ASGI middleware (pure ASGI, so streamed responses pass through untouched) that answers
    401 to a request for a protected path (see protected_path) without the key."""

    def __init__(
        self, app, key: str | None = None, metrics: bool = False, digest: bytes | None = None
    ):
        if (key is None) == (digest is None):
            raise ValueError("give the API key or its digest (key_digest), one of them")
        if digest is not None and len(digest) != hashlib.sha256().digest_size:
            raise ValueError(f"a key digest is SHA-256's 32 bytes, got {len(digest)}")
        self.app = app
        self._digest = key_digest(key) if key is not None else bytes(digest)
        self.metrics = metrics

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the request's Authorization header carries the key (constant time)."""
        given = b""
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
                break
        # Compared even when absent: no early return whose timing differs.
        return hmac.compare_digest(_digest(given), self._digest) and bool(given)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not protected_path(scope["path"], self.metrics):
            await self.app(scope, receive, send)
            return
        if self.authorized(scope.get("headers") or []):
            await self.app(scope, receive, send)
            return
        has_header = any(n.lower() == b"authorization" for n, _ in scope.get("headers") or [])
        body, headers = _unauthorized(
            "Incorrect API key provided." if has_header
            else "Missing API key: send it as 'Authorization: Bearer KEY'."
        )  # fmt: skip
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def exposed_without_key(host: str, key: str | None) -> bool:
    """Whether a server bound to `host` without a key is reachable from other machines: any
    address but loopback (0.0.0.0 and :: are every interface)."""
    if key:
        return False
    if host.strip().lower() == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[] ")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return True
