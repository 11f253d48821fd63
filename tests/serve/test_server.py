"""`ort-kvlayout serve` as a real process on a tiny synthetic model, through the official
`openai` client: concurrent streams with the greedy tokens of `Runtime.generate` alone, chat,
usage, cancellation by disconnect, bad requests, overload, and clean shutdown."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve_util import TEMPLATE, ServerProcess, asgi_request, library_or_skip, make_served_model

PROMPTS = [
    "Hello world.",
    "The quick brown fox jumps",
    "abc",
    "Serving many requests at once, with pages that follow the live tokens.",
]
LENGTHS = [30, 45, 12, 25]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    library_or_skip()
    return make_served_model(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def tok(model):
    from ort_kvlayout.model.tokenizer import load_tokenizer

    return load_tokenizer(model, backend="tokenizers")


@pytest.fixture(scope="module")
def alone(model, tok):
    from ort_kvlayout.runtime.generation import Runtime

    with Runtime(model) as rt:
        return [
            rt.generate(tok.encode(p), n, eos_token_ids=[]).tokens[0]
            for p, n in zip(PROMPTS, LENGTHS)
        ]


@pytest.fixture(scope="module")
def server(model):
    proc = ServerProcess(model, "--max-batch", "3", "--prefill-chunk", "8", "--model-id", "tiny")
    proc.wait_ready()
    yield proc
    code, _, err = proc.stop()
    assert code == 0, err
    assert "Traceback" not in err


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metrics(server) -> dict[str, float]:
    _, text = get(server.url + "/metrics")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("ort_kvlayout_")] = float(value)
    return out


def wait_cancelled(server, before: float) -> dict[str, float]:
    """The metrics once a cancellation was counted and nothing runs (or after 20 s)."""
    deadline = time.monotonic() + 20
    while True:
        m = metrics(server)
        done = m["requests_cancelled_total"] > before and m["requests_running"] == 0
        if done or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert get(server.url + "/health") == (200, '{"status":"ok"}')
    m = metrics(server)
    assert {"requests_running", "kv_committed_bytes", "preemptions_total"} <= set(m)
    assert {"graph_captures_total", "graph_replays_total", "decode_buckets_used"} <= set(m)
    assert m["graph_captures_total"] == 0  # the CPU runs uncaptured
    assert get(server.url + "/v1/models/other")[0] == 404


def test_concurrent_streams_equal_runtime_alone(server, client, tok, alone):
    got: dict[int, tuple[list[int], str, list]] = {}

    def one(i):
        stream = client.completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=LENGTHS[i], temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        ids, text, chunks = [], "", []
        for c in stream:
            chunks.append(c)
            for choice in c.choices:
                ids += choice.model_extra.get("token_ids") or []
                text += choice.text
        got[i] = (ids, text, chunks)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(PROMPTS)):
        ids, text, chunks = got[i]
        assert ids == alone[i]
        assert text == tok.decode(alone[i])
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == LENGTHS[i]
        assert chunks[-1].usage.prompt_tokens == len(tok.encode(PROMPTS[i]))
    assert metrics(server)["kv_bytes_moved_total"] == 0


def test_raw_sse_frames(server):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as r:
        raw = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/event-stream")
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(f.startswith("data: ") for f in frames[:-1])


def test_chat_completion_uses_the_template(server, client, model, tok):
    from ort_kvlayout.runtime.generation import Runtime

    messages = [{"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt = tok.encode("user: Hi there\nassistant:")
    assert TEMPLATE.startswith("{% for m in messages %}")
    with Runtime(model) as rt:
        expected = rt.generate(prompt, 20, eos_token_ids=[]).tokens[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == tok.decode(expected)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == 20
    assert out.choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text(server, client, tok, alone):
    full = tok.decode(alone[1])
    stop = full[10:12]
    first = full.find(stop)
    out = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=LENGTHS[1], temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].text == full[:first]
    assert out.choices[0].finish_reason == "stop"


def test_bad_requests(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="abc", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="a" * 300, max_tokens=2)
    assert info.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="abc", max_tokens=10_000)
    assert info.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="abc", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="abc", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[99999], max_tokens=2)
    status, body = post(server.url + "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post(server.url + "/v1/completions", b"[1, 2]")
    assert status == 400
    # Unknown fields are tolerated.
    out = client.completions.create(
        model="tiny", prompt="abc", max_tokens=2, extra_body={"some_future_field": {"x": 1}}
    )
    assert out.usage.completion_tokens <= 2
    assert get(server.url + "/nowhere")[0] == 404


def post_raw(server, path: str, text: str) -> tuple[int, dict]:
    """POST a JSON text as written (escapes such as \\ud800 and NaN kept as the client sent them)."""
    return post(server.url + path, text.encode())


def test_lone_surrogates_are_a_400_naming_the_field(server):
    for stream in ("false", "true"):
        status, body = post_raw(
            server, "/v1/completions", f'{{"prompt":"\\ud800abc","max_tokens":2,"stream":{stream}}}'
        )
        assert status == 400, body
        assert body["error"]["param"] == "prompt"
        assert "not valid Unicode text (a lone surrogate at index 0)" in body["error"]["message"]
    status, body = post_raw(
        server, "/v1/chat/completions",
        '{"messages":[{"role":"user","content":"\\udfffhi"}],"max_tokens":2}',
    )  # fmt: skip
    assert status == 400 and body["error"]["param"] == "messages[0].content"
    status, body = post_raw(
        server, "/v1/completions", '{"prompt":"abc","max_tokens":2,"stop":["\\udc00"]}'
    )
    assert status == 400 and body["error"]["param"] == "stop"


@pytest.mark.parametrize(
    ("text", "param", "message"),
    [
        ('{"prompt":[1.5]}', "prompt", "token ids must be integers"),
        ('{"prompt":[true]}', "prompt", "token ids must be integers"),
        ('{"prompt":["a","b"]}', "prompt", "one prompt per request"),
        ('{"prompt":[99999],"max_tokens":2}', "prompt", "outside the vocabulary"),
        ('{"prompt":"abc","stop_token_ids":[99999999]}', "stop_token_ids", "outside the vocab"),
        ('{"prompt":"abc","temperature":NaN}', "temperature", "must be a finite number"),
        ('{"prompt":"abc","top_p":Infinity}', "top_p", "must be a finite number"),
        ('{"prompt":"abc","max_tokens":0}', "max_tokens", "'max_tokens' must be >= 1, got 0"),
        ('{"prompt":"abc","model":5}', "model", "'model' must be a string"),
        ('{"prompt":"abc","response_format":{"type":"json_object"}}', "response_format", ""),
        ('{"prompt":"abc","suffix":"end"}', "suffix", "not supported"),
        ('{"prompt":"abc","logprobs":0}', "logprobs", "not supported"),
    ],
)
def test_completion_refusals_name_the_field(server, text, param, message):
    status, body = post_raw(server, "/v1/completions", text)
    assert status == 400, body
    assert body["error"]["param"] == param and message in body["error"]["message"]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": []}], "messages[0].content"),
        (
            [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}],
            "messages[1].role",
        ),
    ],
)
def test_chat_messages_are_checked(server, messages, param):
    status, body = post(
        server.url + "/v1/chat/completions",
        json.dumps({"messages": messages, "max_tokens": 2}).encode(),
    )
    assert status == 400 and body["error"]["param"] == param, body


def test_chat_developer_is_the_system_prompt(server, client, model, tok):
    from ort_kvlayout.runtime.generation import Runtime

    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
    ]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt = tok.encode("system: Be brief.\nuser: Hi\nassistant: \nassistant:")
    with Runtime(model) as rt:
        expected = rt.generate(prompt, 5, eos_token_ids=[]).tokens[0]
    assert out.usage.prompt_tokens == len(prompt)
    assert out.choices[0].message.content == tok.decode(expected)


def test_a_huge_prompt_does_not_stall_the_server(server):
    """A 12 MB prompt (over the context): /health answers while it is read and refused."""
    body = json.dumps({"prompt": "hello " * 2097152, "max_tokens": 2}).encode()
    got = {}

    def send():
        got["status"], got["body"] = post(server.url + "/v1/completions", body)

    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        start = time.monotonic()
        assert get(server.url + "/health")[0] == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.01)
    sender.join()
    assert got["status"] == 413 and got["body"]["error"]["code"] == "context_length_exceeded"
    assert slowest < 1.0  # the whole tokenization took seconds here (9 s for 12 MB)


class BlockingTokenizer:
    """Blocks in encode until released (or 5 s pass); says whether it is inside."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        self.inside = False

    def encode(self, text: str) -> list[int]:
        self.inside = True
        self.entered.set()
        self.release.wait(5)
        self.inside = False
        return [1, 2, 3]


class RefusingEngine:
    """An engine without a spec (as a cluster's): submit refuses with `error`."""

    capacity = 1 << 16
    closing = False

    def __init__(self, error: Exception):
        self.error = error

    def submit(self, prompt, params):
        raise self.error


async def asgi(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    """One request through the ASGI app: (status, JSON body)."""
    status, raw = await asgi_request(app, method, path, body)
    return status, json.loads(raw)


def test_health_answers_while_a_large_body_is_parsed():
    from ort_kvlayout.serve.engine import EngineOverloaded
    from ort_kvlayout.serve.server import INLINE_PARSE_BYTES, build_app

    tok = BlockingTokenizer()
    app = build_app(RefusingEngine(EngineOverloaded("full")), "m", tokenizer=tok)
    big = json.dumps({"prompt": "a" * (INLINE_PARSE_BYTES + 1)}).encode()

    async def main():
        request = asyncio.create_task(asgi(app, "POST", "/v1/completions", big))
        # Waited for from a thread: a loop blocked in the tokenizer cannot see it otherwise.
        assert await asyncio.to_thread(tok.entered.wait, 10)
        start = time.monotonic()
        health = await asgi(app, "GET", "/health")
        answered_inside, elapsed = tok.inside, time.monotonic() - start
        tok.release.set()
        return health, answered_inside, elapsed, await request

    health, answered_inside, elapsed, refused = asyncio.run(main())
    assert health == (200, {"status": "ok"})
    assert answered_inside  # while the tokenizer was still at work
    assert elapsed < 2.0
    assert refused[0] == 503  # the request went on to the engine


def test_engine_refusals_name_the_field():
    from ort_kvlayout.serve.server import build_app

    for error, extra, param in [
        (ValueError("token ids [999] outside the vocabulary [0, 64)"), {}, "prompt"),
        (ValueError("stop strings need a tokenizer (the model directory has none)"),
         {"stop": ["x"]}, "stop"),
    ]:  # fmt: skip
        app = build_app(RefusingEngine(error), "m")  # no tokenizer
        body = json.dumps({"prompt": [999], "max_tokens": 2, **extra}).encode()
        status, got = asyncio.run(asgi(app, "POST", "/v1/completions", body))
        assert status == 400 and got["error"]["param"] == param


def test_disconnect_cancels_and_frees_pages(server):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 200, "stream": True,
            "ignore_eos": True}  # fmt: skip
    before = metrics(server)["requests_cancelled_total"]
    request = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    r = urllib.request.urlopen(request, timeout=30)
    r.readline()  # the first frame arrived: the request runs
    r.close()
    m = wait_cancelled(server, before)
    assert m["requests_cancelled_total"] == before + 1
    assert m["requests_running"] == 0 and m["kv_committed_bytes"] == 0


def test_disconnect_of_a_plain_request_cancels_it(server):
    import socket

    body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 250, "ignore_eos": True,
                       "temperature": 0})  # fmt: skip
    before = metrics(server)["requests_cancelled_total"]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        deadline = time.monotonic() + 20
        while metrics(server)["requests_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    m = wait_cancelled(server, before)
    assert m["requests_cancelled_total"] == before + 1
    assert m["kv_committed_bytes"] == 0


def test_overload_answers_503(model):
    proc = ServerProcess(model, "--max-batch", "1", "--max-waiting", "0").wait_ready()
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(
            model="seq", prompt="abc", max_tokens=200, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="seq", prompt="abc", max_tokens=2)
        assert info.value.status_code == 503
        stream.close()
    finally:
        code, _, err = proc.stop(signal.SIGINT)
    assert code == 0 and "Traceback" not in err


def test_sigterm_drains_running_streams(model):
    proc = ServerProcess(model, "--max-batch", "2").wait_ready()
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model="seq", prompt="abc", max_tokens=60, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [next(iter(stream))]
    proc.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)  # the running request finishes
    code, _, err = proc.stop()
    assert sum(len(c.choices[0].text) for c in chunks if c.choices) > 0
    assert chunks[-1].choices[0].finish_reason == "length"
    assert code == 0 and "Traceback" not in err


def run_cli(*args: str, cwd=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ort_kvlayout.serve.cli", "serve", *args],
        check=False, capture_output=True, text=True, timeout=timeout, cwd=cwd,
    )  # fmt: skip


def test_cli_faults(model, tmp_path):
    r = run_cli("")
    assert r.returncode == 2 and r.stderr.startswith("error: MODEL_DIR is empty")
    r = run_cli(str(tmp_path / "missing"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run_cli(str(tmp_path))
    assert r.returncode == 2 and "no genai_config.json" in r.stderr
    r = run_cli(str(model), "--kv-budget", "100000GiB")
    assert r.returncode == 2 and "more than this machine's memory" in r.stderr
    r = run_cli(str(model), "--cuda-graph")
    assert r.returncode == 2 and "cuda_graph=True needs provider='cuda'" in r.stderr
    r = run_cli(str(model), "--kv-budget", "0")
    assert r.returncode == 2 and "a fraction of free memory is in (0, 1]" in r.stderr
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    config = json.loads((broken / "genai_config.json").read_text())
    config["model"]["decoder"]["num_hidden_layers"] = 10**9
    (broken / "genai_config.json").write_text(json.dumps(config))
    start = time.monotonic()
    r = run_cli(str(broken))
    assert r.returncode == 2 and "num_hidden_layers = 1000000000 is out of range" in r.stderr
    assert time.monotonic() - start < 30 and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("model.context_length", 10**12, "context_length = 1000000000000 is out of range"),
        ("model.eos_token_id", [2, 100000], "eos_token_id = 100000 is out of range"),
        ("model.pad_token_id", -1, "pad_token_id = -1 is out of range"),
        ("model.decoder.num_key_value_heads", 0, "num_key_value_heads = 0 is out of range"),
        ("model.decoder.num_hidden_layers", "two", "malformed"),
    ],
)
def test_genai_config_checked_before_allocation(model, tmp_path, key, value, message):
    from ort_kvlayout.model.config import MetadataError
    from ort_kvlayout.runtime.kv_memory import allocator_stats
    from ort_kvlayout.serve.engine import Engine

    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    config = json.loads((broken / "genai_config.json").read_text())
    *parents, last = key.split(".")
    node = config
    for p in parents:
        node = node[p]
    node[last] = value
    (broken / "genai_config.json").write_text(json.dumps(config))
    before = allocator_stats()["cpu"]
    with pytest.raises(MetadataError, match=message):
        Engine(broken)
    assert allocator_stats()["cpu"] == before


def test_relative_model_dir_loads_the_library_from_the_model(model):
    proc = ServerProcess(model.name, cwd=model.parent).wait_ready()
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="seq", prompt="abc", max_tokens=3).choices
    finally:
        code, _, err = proc.stop()
    assert code == 0, err


def test_kv_budget_and_bucket_arguments():
    from ort_kvlayout.serve.cli import parse_buckets, parse_budget

    assert parse_budget("0.9") == (None, 0.9)
    assert parse_budget("90%") == (None, 0.9)
    assert parse_budget("1") == (None, 1.0)  # all the free memory
    assert parse_budget("2GiB") == (2 << 30, None)
    assert parse_budget("1e9") == (10**9, None)
    assert parse_budget("512 MiB") == (512 << 20, None)
    assert parse_buckets("1,2,4,8") == (1, 2, 4, 8)
    for bad in ("0", "120%", "-1", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_budget(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_buckets("1,0")
