"""Support for the engine and server tests: a tiny patched model with a character tokenizer and
a chat template, a real `ort-kvlayout serve` process on it, and the library check."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from synthetic_models import VOCAB, Variant, make_model_dir

SPECIALS = ["<pad>", "<s>", "</s>", "<eos>"]  # ids 0-3: pad, bos and the two EOS ids
CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,!?:\n'")
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
# The graphs an engine step can run, as EngineConfig arguments: the served graph packed (the
# default), packed with mixed calls, the served graph unpacked, the model's own graph.
ENGINE_GRAPHS = {
    "packed": {},
    "packed-mixed": {"mixed": True},
    "served": {"packed": False},
    "own-graph": {"sample_on_device": False},
}
assert len(SPECIALS) + len(CHARS) == VOCAB


def library_or_skip() -> None:
    import ort_kvlayout
    import pytest

    try:
        ort_kvlayout.library_path()
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"custom-op library not built: {exc}")


def write_char_tokenizer(model_dir: Path) -> None:
    """tokenizer.json: one token per character (no merges), specials skipped when decoding."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)


def make_served_model(root: Path, layers: int = 2) -> Path:
    from ort_kvlayout.tools.patch import patch_model_dir

    src = make_model_dir(root / "original", Variant(layers=layers))
    write_char_tokenizer(src)
    return patch_model_dir(src, root / "seq", layout="seq-major").out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m ort_kvlayout.serve.cli serve MODEL_DIR --port P ...` until stop()."""

    def __init__(self, model_dir: Path | str, *args: str, cwd: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ort_kvlayout.serve.cli", "serve", str(model_dir),
               "--port", str(self.port), *args]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
        )

    def wait_ready(self, timeout: float = 60) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                _, err = self.proc.communicate()
                raise RuntimeError(f"server exited {self.proc.returncode}: {err}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=1) as r,
            ):
                if r.status == 200:
                    return self
            time.sleep(0.1)
        raise TimeoutError("the server did not become ready")

    def stop(self, sig=None, timeout: float = 30) -> tuple[int, str, str]:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, out, err


async def asgi_request(app, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request through an ASGI app, without a server: (status, the response's bytes). The
    client sends `body` and then stays (it never disconnects)."""
    sent, bodies = [], [body]

    async def receive():
        if bodies:
            return {"type": "http.request", "body": bodies.pop(), "more_body": False}
        await asyncio.sleep(3600)  # a client that stays

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "method": method, "path": path, "headers": [], "query_string": b"",
        "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "root_path": "",
    }  # fmt: skip
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent)
