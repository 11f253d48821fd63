"""`ort-kvlayout serve --replicas 2` on the CPU with the tiny model, as a real process through
Ray Serve: the key on every /v1/* route, a 64-request burst with the greedy tokens of one
engine alone spread over both replicas, streaming with usage, refusals, a disconnect, overload
at the queue limit, a killed replica, and a SIGTERM drain; every request counted to its end.
Skipped without the cluster extra (ray[serve])."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from ort_kvlayout.serve.auth import API_KEY_ENV
from ort_kvlayout.serve.cluster.router import load_key
from serve_util import ServerProcess, library_or_skip, make_served_model

KEY = "sk-cluster-test"
SLOTS, WAITING = 3, 32  # per replica: 2 x (3 + 32) = 70 requests held at once
CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,!?"


def burst_prompts(n: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs, of different lengths."""
    return [(CHARS[i % 17 :][: 3 + (i * 7) % 30] or "a", 4 + (i * 5) % 27) for i in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    library_or_skip()
    return make_served_model(tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def cluster(model):
    old = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = KEY  # the key through the environment, out of `ps`
    try:
        proc = ServerProcess(
            model, "--replicas", "2", "--max-batch", str(SLOTS), "--max-waiting", str(WAITING),
            "--prefill-chunk", "8", "--model-id", "tiny", "--drain-timeout", "60",
        )  # fmt: skip
    finally:
        if old is None:
            del os.environ[API_KEY_ENV]
        else:
            os.environ[API_KEY_ENV] = old
    try:
        proc.wait_ready(timeout=180)
        wait_for(lambda: len(replicas(proc)) == 2, 120, "two replicas reporting")
    except BaseException:
        proc.stop(signal.SIGKILL)
        raise
    yield proc
    if proc.proc.poll() is None:  # the drain test stops it; otherwise stop it here
        code, _, err = proc.stop(timeout=120)
        assert code == 0, err


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.2)


def get(url: str, key: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, None, headers), timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metrics(proc) -> dict[tuple[str, str], float]:
    """(metric, replica) -> value; replica "" for a metric without one."""
    out = {}
    for line in get(proc.url + "/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            replica = re.search(r'replica="(\w+)"', name)
            metric = name.split("{")[0].removeprefix("ort_kvlayout_")
            out[(metric, replica.group(1) if replica else "")] = float(value)
    return out


def replicas(proc) -> dict[str, int]:
    """Replica id -> its process id, as /metrics names them."""
    text = get(proc.url + "/metrics")[1]
    return {
        r: int(p) for r, p in re.findall(r'replica_info\{[^}]*replica="(\w+)",pid="(\d+)"', text)
    }


def total(proc, metric: str) -> float:
    return sum(v for (m, _), v in metrics(proc).items() if m == metric)


def stream(port: int, body: dict, key: str = KEY, started=None) -> tuple[int, list]:
    """POSTs a streamed completion; (status, its data frames as parsed JSON or "[DONE]"), or
    (status, [error body]) when it is refused before streaming. started() (optional) is
    called when its first frame came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # fmt: skip
        r = conn.getresponse()
        if r.status != 200:
            return r.status, [json.loads(r.read())]
        frames = []
        for line in r:
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                frames.append(data if data == "[DONE]" else json.loads(data))
                if len(frames) == 1 and started is not None:
                    started()
        return 200, frames
    finally:
        conn.close()


def tokens(frames: list) -> list[int]:
    return [t for f in frames if isinstance(f, dict) for c in f.get("choices", [])
            for t in c.get("token_ids") or []]  # fmt: skip


def finish(frames: list) -> str | None:
    reasons = [c["finish_reason"] for f in frames if isinstance(f, dict)
               for c in f.get("choices", []) if c.get("finish_reason")]  # fmt: skip
    return reasons[-1] if reasons else None


def test_load_key_orders_replicas():
    stats = {"max_batch": 4, "kv_budget_bytes": 1000, "kv_committed_bytes": 0,
             "kv_bytes_per_token": 10.0}  # fmt: skip
    idle = load_key(stats, 0, 50, 9)
    busy = load_key(stats, 2, 50, 9)
    full = load_key(stats, 4, 50, 9)  # every slot taken
    queued = load_key(stats, 6, 50, 9)  # two waiting
    low_kv = load_key({**stats, "kv_committed_bytes": 600}, 0, 50, 9)  # 400 free < 500 needed
    more_kv = load_key({**stats, "kv_committed_bytes": 100}, 1, 5, 9)
    less_kv = load_key({**stats, "kv_committed_bytes": 300}, 1, 5, 9)
    assert sorted([queued, full, low_kv, busy, idle]) == [idle, busy, low_kv, full, queued]
    assert more_kv < less_kv
    # Unknown live count: what the replica reported (running + waiting).
    assert load_key({**stats, "running": 4, "waiting": 1}, None, 5, 9) == (True, 1, 5, -1000)


def test_key_health_models_and_labelled_metrics(cluster, client):
    psutil = pytest.importorskip("psutil")
    # the default ingress: Ray's HAProxy in front of the ingress replica (ingress_mode.py), a
    # process of this cluster's tree
    tree = psutil.Process(cluster.proc.pid).children(recursive=True)
    assert any(p.name() == "haproxy" for p in tree)
    assert get(cluster.url + "/health") == (200, '{"status":"ok"}')
    for path in ("/v1/models", "/v1/models/tiny"):
        assert get(cluster.url + path)[0] == 401
        assert get(cluster.url + path, "sk-wrong")[0] == 401
    status, _ = stream(cluster.port, {"model": "tiny", "prompt": "abc", "max_tokens": 2}, "nope")
    assert status == 401
    assert [m.id for m in client.models.list().data] == ["tiny"]
    m = metrics(cluster)
    assert m[("replicas", "")] == 2
    ids = set(replicas(cluster))
    assert len(ids) == 2 and {r for (k, r) in m if k == "requests_running"} == ids


def test_burst_equals_one_engine_and_uses_both_replicas(cluster, client, model):
    from ort_kvlayout.model.tokenizer import load_tokenizer
    from ort_kvlayout.runtime.generation import Runtime

    tok = load_tokenizer(model, backend="tokenizers")
    work = burst_prompts(64)

    def chat(i: int) -> bool:
        return i % 4 == 3  # chat, streamed, with usage; else plain (odd) or streamed (even)

    with Runtime(model) as rt:
        expected = [
            rt.generate(tok.encode(f"user: {p}\nassistant:" if chat(i) else p), n,
                        eos_token_ids=[]).tokens[0]
            for i, (p, n) in enumerate(work)
        ]  # fmt: skip
    before = {r: metrics(cluster).get(("requests_admitted_total", r), 0) for r in replicas(cluster)}
    got: dict[int, object] = {}

    def one(i: int) -> None:
        prompt, n = work[i]
        extra = {"ignore_eos": True, "return_token_ids": True, "temperature": 0}
        try:
            if chat(i):
                s = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=n,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                chunks = list(s)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                got[i] = ("chat", text, chunks[-1].usage.completion_tokens)
            elif i % 2:
                out = client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                                temperature=0, extra_body=extra)  # fmt: skip
                got[i] = ("plain", out.choices[0].model_extra["token_ids"], out.usage)
            else:
                got[i] = ("stream", *stream(cluster.port, {"model": "tiny", "prompt": prompt,
                                                           "max_tokens": n, **extra}))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 -- counted below
            got[i] = ("failed", repr(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(got) == len(work), "a request never ended"
    failed = {i: g for i, g in got.items() if g[0] == "failed"}
    assert not failed
    for i, (prompt, n) in enumerate(work):
        kind, *rest = got[i]
        if kind == "chat":
            assert rest == [tok.decode(expected[i]), n], i
        elif kind == "plain":
            assert rest[0] == expected[i] and rest[1].completion_tokens == n, i
        else:
            status, frames = rest
            assert status == 200 and tokens(frames) == expected[i], i
            assert finish(frames) == "length" and frames[-1] == "[DONE]"

    def admitted() -> dict[str, float] | None:
        now = {r: metrics(cluster).get(("requests_admitted_total", r), 0) for r in before}
        return now if sum(now.values()) - sum(before.values()) >= len(work) else None

    now = wait_for(admitted, 10, "the replicas' stats to count the burst")
    assert all(now[r] > before[r] for r in before), (before, now)  # both replicas served


def test_refusals_through_the_cluster(cluster, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="abc", max_tokens=2)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="abc", max_tokens=10_000)
    assert info.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[99999], max_tokens=2)
    assert "outside the vocabulary" in info.value.body["message"]  # the engine's own words
    assert "Traceback" not in info.value.body["message"]


def test_disconnect_cancels_on_the_replica(cluster):
    before = total(cluster, "requests_cancelled_total")
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=30)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 250, "ignore_eos": True,
            "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})  # fmt: skip
    r = conn.getresponse()
    r.readline()  # the first frame: it runs
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: total(cluster, "requests_cancelled_total") > before, 30, "the cancellation")
    wait_for(lambda: total(cluster, "requests_running") == 0, 30, "the slot to be freed")


def run_streams(port: int, n: int, max_tokens: int, started=None) -> tuple[list, list, list]:
    """n streams started at once: (their results as stream() gives them, filled as they end;
    when each ended, time.monotonic(); the threads to join). started: a semaphore released
    at each stream's first frame."""
    results: list = [None] * n
    ended: list = [None] * n

    def one(i: int) -> None:
        try:
            body = {"model": "tiny", "prompt": CHARS[i % 20 :][:6], "max_tokens": max_tokens,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            results[i] = stream(port, body, started=started.release if started else None)
        except Exception as exc:  # noqa: BLE001 -- a request lost: the test says so
            results[i] = (0, [repr(exc)])
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return results, ended, threads


def test_overload_answers_503_and_every_request_ends(cluster):
    # 50 more than both replicas' slots and queues hold, all at once: those that find every
    # queue full get 503, as from one server; the rest run to their end.
    n = 2 * (SLOTS + WAITING) + 50
    results, _, threads = run_streams(cluster.port, n, 200)
    for t in threads:
        t.join(300)
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(served) + len(refused) == n, [r for r in results if r[0] not in (200, 503)]
    assert refused and len(served) >= 2 * (SLOTS + WAITING) // 2
    for _, frames in served:
        assert len(tokens(frames)) == 200 and finish(frames) == "length"
    for _, (error,) in refused:
        assert error["error"]["type"] == "server_error"
        assert f"requests are waiting (limit {WAITING})" in error["error"]["message"]


def per_replica(proc, metric: str) -> dict[str, float]:
    return {r: v for (m, r), v in metrics(proc).items() if m == metric and r}


def test_killed_replica_aborts_its_streams_only_and_comes_back(cluster):
    before = replicas(cluster)
    # Seconds of work on each replica (slots busy, most of its queue full), so that the stats
    # (0.5 s old at most) still show it running when it is killed.
    n = 2 * (SLOTS + WAITING) - 10
    started = threading.Semaphore(0)
    results, _, threads = run_streams(cluster.port, n, 250, started)
    # 2 x SLOTS streams with tokens out: both replicas run SLOTS each (a replica runs SLOTS at
    # most), so the victim's running streams abort and the other's run whole.
    for _ in range(2 * SLOTS):
        assert started.acquire(timeout=60)

    def busiest() -> str | None:  # the replica with the longest queue, once it has one
        waiting = per_replica(cluster, "requests_waiting")
        load = {r: waiting.get(r, 0) for r in before}
        victim = max(load, key=load.get)
        return victim if load[victim] >= SLOTS else None

    # Its queue is refused before a first token (lost). Waiting for both queues at once raced
    # their draining: a replica given fewer requests empties its queue first, and /metrics,
    # polled through the busy ingress, can come late (a CI run timed out so).
    victim_id = wait_for(busiest, 60, "a replica with a queue")
    victim_pid = before[victim_id]
    os.kill(victim_pid, signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert all(r is not None for r in results)
    whole = [f for st, f in results if st == 200 and finish(f) == "length"]
    aborted = [f for st, f in results if st == 200 and finish(f) == "abort"]
    lost = [f for st, f in results if st == 503 and "replica" in f[0]["error"]["message"]]
    full = [f for st, f in results if st == 503 and "overloaded" in f[0]["error"]["message"]]
    summary = [(st, finish(f) if st == 200 else f) for st, f in results]
    # Every request ended: with its tokens, aborted mid-stream, refused before its first token
    # (queued on the lost replica), or (the router's counts are not exact) refused as overload.
    assert len(whole) + len(aborted) + len(lost) + len(full) == n, summary
    assert whole and aborted and lost, summary
    for frames in whole:
        assert len(tokens(frames)) == 250 and frames[-1] == "[DONE]"
    for frames in aborted:  # finish_reason "abort", then the error, then [DONE]
        error = [f for f in frames if isinstance(f, dict) and "error" in f]
        assert len(error) == 1 and "replica" in error[0]["error"]["message"]
        assert frames[-1] == "[DONE]" and len(tokens(frames)) < 250
    for (error,) in lost:
        assert "replica" in error["error"]["message"]
    # Ray starts a replica in its place; it serves.
    after = wait_for(lambda: (r := replicas(cluster)) and len(r) == 2 and victim_id not in r and r,
                     120, "a new replica")  # fmt: skip
    assert victim_pid not in after.values()
    status, frames = stream(cluster.port, {"model": "tiny", "prompt": "abc", "max_tokens": 5,
                                           "return_token_ids": True, "ignore_eos": True})  # fmt: skip
    assert status == 200 and len(tokens(frames)) == 5


def test_sigterm_drains_every_replica(cluster):
    n = 2 * SLOTS + 4  # running on both replicas, and some waiting
    started = threading.Semaphore(0)
    results, ended, threads = run_streams(cluster.port, n, 200, started)
    for _ in range(2 * SLOTS):  # both replicas' slots busy, the rest queued
        assert started.acquire(timeout=60)
    signalled = time.monotonic()
    cluster.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(300)
    code, _, err = cluster.stop(timeout=120)
    exited = time.monotonic()
    assert code == 0, err
    assert "Traceback" not in err
    # once the streams end, the cluster goes (Ray's 30 s hold of a stopping direct-ingress
    # replica is shortened for the one HAProxy in front of it: ingress_mode.py)
    assert exited - max(ended) < 20, exited - max(ended)
    summary = [(st, finish(f), len(tokens(f)), t - signalled) for (st, f), t in zip(results, ended)]
    for status, frames in results:
        assert status == 200 and finish(frames) == "length" and len(tokens(frames)) == 200, (
            summary,
            err[-3000:],
        )
    assert max(ended) > signalled  # streams ran on after the signal, to their end
