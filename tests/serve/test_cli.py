"""`ort-kvlayout serve`'s command line as a user meets it (subprocesses on a tiny synthetic
model): the KV budget's text (a fraction, whole bytes, never 1.5 read as 1 byte) and a budget
too small for one token, a port already in use (one line, no banner), MODEL_DIR missing or a
file, and SIGTERM with running requests past --drain-timeout (they end with finish_reason
"abort", the stream with its last chunk and [DONE]; exit 0, no traceback)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import ort_kvlayout
import pytest

PYTHONPATH = str(Path(ort_kvlayout.__file__).resolve().parents[1])


def _env() -> dict[str, str]:
    extra = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=PYTHONPATH + os.pathsep + extra, PYTHONUNBUFFERED="1")


def serve(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ort_kvlayout.serve.cli", "serve", *args],
        check=False, capture_output=True, text=True, timeout=timeout, env=_env(),
    )  # fmt: skip


def assert_one_line_error(run: subprocess.CompletedProcess, *needles: str) -> str:
    err = run.stderr
    assert run.returncode == 2, (run.returncode, err)
    assert "Traceback" not in err and "serving" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from serve_util import library_or_skip, make_served_model

    library_or_skip()
    return make_served_model(tmp_path_factory.mktemp("cli"))


# ---------------------------------------------------------------------------------------------
# --kv-budget


def test_kv_budget_text():
    from ort_kvlayout.serve.arguments import parse_budget, parse_bytes

    assert parse_budget("1e9") == (10**9, None)
    assert parse_budget("1000") == (1000, None)
    assert parse_budget("1") == (None, 1.0)
    assert parse_budget("0.5") == (None, 0.5)
    assert parse_budget("10TiB") == (10 << 40, None)
    assert parse_budget("2T") == (2 << 40, None)
    assert parse_budget("2TB") == (2 * 10**12, None)
    assert parse_budget("1.5GiB") == (3 << 29, None)
    assert parse_budget("1.5e9") == (1_500_000_000, None)
    assert parse_bytes("3 tib") == 3 << 40


@pytest.mark.parametrize("text", ["1.5", "2.25", "1000.5", "inf", "nan", "1.5b"])
def test_kv_budget_neither_fraction_nor_whole_bytes_is_refused(text):
    from ort_kvlayout.serve.arguments import parse_budget

    with pytest.raises(argparse.ArgumentTypeError, match="whole number"):
        parse_budget(text)


def test_kv_budget_fraction_above_one_exits_2(model):
    run = serve(str(model), "--kv-budget", "1.5")
    assert run.returncode == 2, run.stderr
    assert "a fraction of free memory is in (0, 1]; bytes are a whole number" in run.stderr
    assert "serving" not in run.stderr and "Traceback" not in run.stderr


def test_kv_budget_below_one_token_is_refused_at_start(model):
    """The engine refuses such a budget (so does a cluster's replica); the CLI says why."""
    line = assert_one_line_error(serve(str(model), "--kv-budget", "1000"))
    assert "a KV budget of 1000 bytes cannot hold one token" in line
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    with Engine(model, EngineConfig(max_batch=1)) as engine:
        need = engine.cache.entry_commit_bytes(1)
    assert need > 1000 and f"commits {need} KV bytes" in line
    with pytest.raises(ValueError, match=f"first token commits {need} KV bytes"):
        Engine(model, EngineConfig(max_batch=1, kv_budget_bytes=need - 1))
    with Engine(model, EngineConfig(max_batch=1, kv_budget_bytes=need)) as engine:
        assert engine.budget == need


# ---------------------------------------------------------------------------------------------
# The port


def test_port_in_use_is_one_line_and_no_banner(model):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = assert_one_line_error(serve(str(model), "--port", str(port)))
    assert line == f"error: cannot listen on 127.0.0.1:{port}: address already in use"


def test_bind_sockets_holds_the_port():
    from ort_kvlayout.serve.listen import ListenError, bind_sockets

    sockets = bind_sockets("127.0.0.1", 0)
    try:
        port = sockets[0].getsockname()[1]
        assert port != 0
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}: address already in use"):
            bind_sockets("127.0.0.1", port)
    finally:
        for sock in sockets:
            sock.close()
    with pytest.raises(ListenError, match="cannot listen on no-such-host.invalid:80"):
        bind_sockets("no-such-host.invalid", 80)
    if socket.has_ipv6:
        try:
            six = bind_sockets("::1", 0)
        except ListenError:
            return  # no IPv6 loopback here
        try:
            assert six[0].family == socket.AF_INET6
        finally:
            for sock in six:
                sock.close()


@pytest.mark.parametrize("port", ["65536", "-1", "http"])
def test_port_out_of_range_is_a_usage_error(port):
    run = serve("--port", port)
    assert run.returncode == 2 and "--port" in run.stderr and "Traceback" not in run.stderr


# ---------------------------------------------------------------------------------------------
# MODEL_DIR


def test_model_dir_missing_or_a_file(tmp_path):
    missing = tmp_path / "missing"
    assert_one_line_error(serve(str(missing)), f"MODEL_DIR {missing} does not exist")
    file = tmp_path / "file"
    file.write_text("x")
    assert_one_line_error(serve(str(file)), f"{file} is a file, not a model directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(serve(str(empty)), "no genai_config.json")


# ---------------------------------------------------------------------------------------------
# SIGTERM past --drain-timeout

# The server with each engine step slowed down by 20 ms: a request of 200 tokens takes 4 s or
# more on any machine, so a drain of 1 s always ends with requests still running.
_SLOW_SERVER = """
import sys, time
from ort_kvlayout.serve import engine
step = engine.Engine._step
def slow_step(self):
    time.sleep(0.02)
    return step(self)
engine.Engine._step = slow_step
from ort_kvlayout.serve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, str, str]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def test_sigterm_past_drain_timeout_aborts_running_requests(model):
    from serve_util import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SERVER, "serve", str(model), "--port", str(port),
         "--max-batch", "2", "--drain-timeout", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        body = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True}
        results: dict[str, tuple[int, str, str]] = {}
        streamed = threading.Event()

        def stream() -> None:
            request = urllib.request.Request(
                url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=120) as r:
                lines = [r.readline()]  # the first token: the stream is running
                streamed.set()
                lines += r.readlines()
                results["stream"] = (r.status, "", b"".join(lines).decode())

        def plain() -> None:
            results["plain"] = _post(url + "/v1/completions", body)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert streamed.wait(60), "no stream chunk"
        time.sleep(0.3)  # the plain request is running too (two slots)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(90)
        _, err = proc.communicate(timeout=90)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "ERROR" not in err, err
    assert took < 30, took  # 1 s of drain, not the 4 s the requests would take

    status, _, text = results["stream"]
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", text[-500:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort", chunks[-1]
    assert 1 < len(chunks) < 200  # some tokens, cut short

    status, kind, text = results["plain"]
    assert status == 200 and kind.startswith("application/json"), (status, text)
    answer = json.loads(text)
    assert answer["choices"][0]["finish_reason"] == "abort"
    assert 0 < answer["usage"]["completion_tokens"] < 200


def test_python_dash_m_runs_the_command(tmp_path):
    """`python -m ort_kvlayout` is `ort-kvlayout` (no scripts directory on PATH needed)."""
    run = subprocess.run(
        [sys.executable, "-m", "ort_kvlayout", "serve", str(tmp_path / "missing")],
        check=False, capture_output=True, text=True, timeout=90, env=_env(),
    )  # fmt: skip
    line = assert_one_line_error(run)
    assert line == f"error: MODEL_DIR {tmp_path / 'missing'} does not exist"
