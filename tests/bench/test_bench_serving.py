"""bench/bench_serving.py without a GPU: the named workloads' distributions, the paged model's
block pool at an equal budget, and one small end-to-end run (a tiny random-weight Llama shape
built by the builder, through the engine and og.Engine on the CPU)."""

from __future__ import annotations

import argparse
import enum
import http.server
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from bench_util import load_bench

bench = load_bench("bench_serving", register=True)


def args_for(*argv: str) -> argparse.Namespace:
    ns = argparse.Namespace(
        seed=0, num_requests=200, dataset="random", input_len=128, output_len=64,
        range_ratio=0.5, request_rate=float("inf"), input_range=None, output_range=None,
    )  # fmt: skip
    for flag, value in zip(argv[::2], argv[1::2]):
        setattr(ns, flag.removeprefix("--").replace("-", "_"), value)
    return ns


def test_the_long_context_mix():
    items = bench.workload(args_for("--dataset", "long"), vocab=128256, context=33792)
    ins = np.array([len(i.prompt) for i in items])
    outs = np.array([i.output_len for i in items])
    assert ins.min() >= 8192 and ins.max() <= 32768 and ins.max() > 30000 and ins.min() < 10000
    assert outs.min() >= 128 and outs.max() <= 512
    assert all(len(i.prompt) + i.output_len <= 33792 for i in items)
    again = bench.workload(args_for("--dataset", "long"), vocab=128256, context=33792)
    assert [i.prompt[:4] for i in again] == [i.prompt[:4] for i in items]  # seeded
    # Clipped to a smaller context (SmolLM2's 8k): prompt + output stays inside it.
    small = bench.workload(args_for("--dataset", "long"), vocab=49152, context=8192)
    assert all(len(i.prompt) + i.output_len <= 8192 for i in small)


def test_ranges_override_a_named_workload_and_poisson_arrivals():
    ns = args_for("--dataset", "chat", "--input-range", (10, 20), "--request-rate", 4.0)
    items = bench.workload(ns, vocab=1000, context=4096)
    assert all(10 <= len(i.prompt) <= 20 and 64 <= i.output_len <= 512 for i in items)
    gaps = np.diff([i.arrival for i in items])
    assert items[0].arrival == 0 and (gaps >= 0).all() and 0.15 < gaps.mean() < 0.35
    with pytest.raises(argparse.ArgumentTypeError):
        bench.int_pair("20,10")


def test_the_paged_pool_is_pinned_to_the_budget(tmp_path):
    model = tmp_path / "paged"
    model.mkdir()
    config = {
        "model": {"decoder": {"num_hidden_layers": 16, "num_key_value_heads": 8, "head_size": 64}},
        "engine": {"dynamic_batching": {"block_size": 256, "max_batch_size": 256,
                                        "gpu_utilization_factor": 0.6}},
    }  # fmt: skip
    (model / "genai_config.json").write_text(json.dumps(config))
    (model / "model.onnx").write_bytes(b"onnx")
    token = 16 * 2 * 8 * 64 * 2  # 32 KiB a token, fp16
    assert bench.genai_kv_token_bytes(model) == token
    out, pool = bench.paged_with_budget(model, 10 << 30, 64, tmp_path / "run")
    batching = json.loads((out / "genai_config.json").read_text())["engine"]["dynamic_batching"]
    assert batching["num_blocks"] == (10 << 30) // (256 * token) == 1280
    assert "gpu_utilization_factor" not in batching and batching["max_batch_size"] == 64
    assert pool == 1280 * 256 * token <= 10 << 30
    assert (out / "model.onnx").resolve() == (model / "model.onnx").resolve()
    out, pool = bench.paged_with_budget(model, None, 8, tmp_path / "run2")
    assert pool is None
    batching = json.loads((out / "genai_config.json").read_text())["engine"]["dynamic_batching"]
    assert "num_blocks" not in batching and batching["gpu_utilization_factor"] == 0.6


def test_shapes():
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        shape = bench.SHAPES[name]
        assert shape["hidden_size"] == shape["num_attention_heads"] * shape["head_dim"]
        assert shape["max_position_embeddings"] >= 32768 + 512  # the long mix fits
    assert bench.SHAPES["llama-3.1-8b"]["num_hidden_layers"] == 32


def test_end_to_end_on_a_tiny_random_llama(tmp_path, capsys):
    """The whole path on the CPU: the builder makes the model from random weights, the
    patcher its seq-major copy, and the workload runs through the engine, the server (its
    launch timed) and og.Engine."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    from serve_util import library_or_skip

    library_or_skip()
    out = tmp_path / "result.json"
    argv = ["--model-shape", "tiny-llama", "--build-dir", str(tmp_path / "models"),
            "--dataset", "long", "--input-range", "16,48", "--output-range", "3,6",
            "--num-requests", "5", "--max-batch", "2", "--systems", "engine,server,genai",
            "--json", str(out)]  # fmt: skip
    assert bench.main([*argv, "--dry-run"]) == 0
    assert "workload long: 5 requests" in capsys.readouterr().out
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["model_shape"] == "tiny-llama" and record["weights"].startswith("random")
    assert record["workload"]["input_range"] == [16, 48]
    for system in ("engine", "server", "genai"):
        r = record["results"][system]
        assert r["completed"] == 5 and 15 <= r["output_tokens"] <= 30
    assert record["results"]["engine"]["output_throughput_vs_genai"] > 0
    server = record["results"]["server"]
    assert 0 < server["ready_s"] < 300 and server["runs_ready_s"] == [server["ready_s"]]
    assert "ready_s" not in record["results"]["engine"]  # in-process: nothing launched
    ready = f"Launch to the first answered request (median of the runs): server {server['ready_s']:.1f} s."
    assert ready in capsys.readouterr().out


def test_repeated_runs_keep_their_order_beside_the_median(tmp_path):
    """--repeat: the row is the run of median output tok/s; every run's rate is kept lowest
    first and in the order the runs took turns, which the report shows."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    from serve_util import library_or_skip

    library_or_skip()
    out = tmp_path / "result.json"
    argv = ["--model-shape", "tiny-llama", "--build-dir", str(tmp_path / "models"),
            "--input-len", "8", "--output-len", "4", "--num-requests", "3", "--max-batch", "2",
            "--systems", "engine", "--repeat", "3", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    r = record["results"]["engine"]
    assert len(r["runs_in_order"]) == 3
    assert sorted(r["runs_in_order"]) == r["runs_output_throughput"]
    assert r["output_throughput"] == r["runs_output_throughput"][1]
    report = load_bench("report")
    each = ", ".join(f"{t:.1f}" for t in r["runs_in_order"])
    assert f"in the order they ran: engine {each})" in report._runs(record)


def test_kv_quant_runs_the_engine_once_per_cache_scheme(tmp_path):
    """--kv-quant: the engine on the model's own cache and on its int8 PER_TOKEN patch, built
    beside the others; the same budget holds more requests with the smaller cache."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    from serve_util import library_or_skip

    library_or_skip()
    out = tmp_path / "result.json"
    argv = ["--model-shape", "tiny-llama", "--build-dir", str(tmp_path / "models"),
            "--dataset", "long", "--input-range", "200,240", "--output-range", "4,6",
            "--num-requests", "6", "--max-batch", "6", "--systems", "engine",
            "--kv-quant", "none,int8-per-token", "--capacity", "256",
            "--kv-budget", str(3 * 256 * 2 * 2 * 2 * 16 * 4), "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    plain, quant = results["engine"], results["engine (int8-per-token KV)"]
    assert plain["model"].endswith("-seq-major")
    assert quant["model"].endswith("-seq-major-int8-per-token")
    assert plain["completed"] == quant["completed"] == 6
    # 3 whole fp32 sequences fit the budget, so the engine preempts; int8 codes plus a scale
    # per row hold all 6 in fewer bytes
    assert quant["preemptions"] == 0 < plain["preemptions"]
    assert quant["peak_committed_kv_bytes"] < plain["peak_committed_kv_bytes"]
    with pytest.raises(SystemExit, match="--kv-quant 'int9'"):
        bench.main([*argv, "--kv-quant", "int9"])


# --- Stalls: every run ends by its deadline or stall timeout, and strays never crash it -------


class StubRequest:
    def __init__(self, engine):
        self.engine, self.n, self.closed = engine, 0, False

    def begin_turn(self, prompt, options):
        self.engine.check_thread()
        self.index = len(self.engine.submitted) - 1  # -1: the warm-up request
        self.engine.submitted.append(self)
        self.engine.active.append(self)

    def close(self):
        self.engine.check_thread()
        self.closed = True


class StubTurnOptions:
    def __init__(self, request):
        self.request = request

    def set_max_generated_tokens(self, n):
        self.request.n = n

    def set_min_generated_tokens(self, n):
        pass

    def set_temperature(self, t):
        pass


MADE: list = []  # every StubEngine, the last one the run's


class StubEngine:
    """og.Engine's surface the harness uses. Each run() gives each active request one token (its
    last with MAX_GENERATED_TOKENS), except `silent` ones (by submission order; the warm-up is
    -1): they get nothing, and stay pending unless `drop_silent`. `strays` events of no request of
    ours come with each run() call once the workload began; from run() call `block_at` on,
    run() blocks until `release` is set. Calls from another thread than the maker's raise, as
    og.Engine's do."""

    def __init__(self, config):
        self.__dict__.update(silent=(), drop_silent=False, strays=0, block_at=None, delay=0.0)
        self.__dict__.update(config)
        self.owner = threading.get_ident()
        self.submitted, self.active, self.calls, self.strays_sent = [], [], 0, 0
        self.release = threading.Event()
        MADE.append(self)

    def check_thread(self):
        if threading.get_ident() != self.owner:
            raise RuntimeError("Engine operations must be called from the Engine owner thread.")

    def get_capabilities(self):
        return SimpleNamespace(configured_max_batch_size=4)

    def create_event_buffer(self, n):
        self.check_thread()
        return object()

    def create_request(self):
        self.check_thread()
        return StubRequest(self)

    def has_pending_requests(self):
        self.check_thread()
        dropped = self.silent if self.drop_silent else ()
        return any(r.index not in dropped for r in self.active)

    def run(self, buffer):
        self.check_thread()
        self.calls += 1
        if self.block_at is not None and self.calls >= self.block_at:
            self.release.wait()
        time.sleep(self.delay)
        events = []
        for r in list(self.active):
            if r.index in self.silent:
                continue
            r.n -= 1
            reason = OG.FinishReason.MAX_GENERATED_TOKENS if r.n == 0 else OG.FinishReason.NONE
            events.append(SimpleNamespace(request=r, flags=TOKEN, finish_reason=reason))
            if r.n == 0:
                self.active.remove(r)
        if len(self.submitted) > 1:  # after the warm-up: a None request, and one not ours
            for k in range(self.strays):
                request = None if k % 2 == 0 else StubRequest(self)
                events.append(SimpleNamespace(request=request, flags=TOKEN,
                                              finish_reason=OG.FinishReason.NONE))  # fmt: skip
            self.strays_sent += self.strays
        return events


class FinishReason(enum.Enum):
    NONE = 0
    MAX_GENERATED_TOKENS = 3


TOKEN = SimpleNamespace(value=1)
OG = SimpleNamespace(
    Engine=StubEngine, TurnOptions=StubTurnOptions, FinishReason=FinishReason,
    EngineEventFlags=SimpleNamespace(TOKEN=TOKEN),
)  # fmt: skip


def stub_items(lengths, arrivals=None):
    arrivals = arrivals or [0.0] * len(lengths)
    return [bench.Item([16 + i] * 12, n, a) for i, (n, a) in enumerate(zip(lengths, arrivals))]


def run_stub_genai(config, items, deadline=30.0, stall=0.5):
    MADE.clear()
    start = time.perf_counter()
    result = bench._run_genai(OG, config, items, deadline, stall)
    return result, time.perf_counter() - start, MADE[-1]


def test_genai_events_without_a_request_of_ours_are_counted_not_fatal():
    items = stub_items([5, 3, 4])
    result, _, engine = run_stub_genai({"strays": 2}, items)
    assert engine.strays_sent > 0 and result["stray_events"] == engine.strays_sent
    assert result["completed"] == 3 and result["output_tokens"] == 12
    assert not result["stalled"] and result["unfinished_requests"] == 0
    assert result["stopped_by"] is None and result["max_concurrency"] == 4
    assert all(r.closed for r in engine.submitted)  # closed by the worker, its owner thread


@pytest.mark.parametrize("drop", [False, True], ids=["still-pending", "dropped"])
def test_genai_requests_that_never_get_an_event_stall_the_run(drop):
    """og.Engine goes silent on two requests (the paged engine's 7 of 64): the run returns at
    the stall timeout (or at once when og.Engine holds nothing more), with what came before."""
    items = stub_items([5, 3, 4, 6, 2, 7])
    result, took, engine = run_stub_genai({"silent": (3, 5), "drop_silent": drop}, items)
    assert took < 0.5 + 5.0 and (took >= 0.5) != drop
    assert result["stalled"] and result["stopped_by"] == ("idle" if drop else "stall")
    assert result["unfinished_requests"] == 2 and result["requests"] == 6
    assert result["completed"] == 4 and result["output_tokens"] == 5 + 3 + 4 + 2
    # Throughput over the time to the last event, not to the moment the run was given up.
    assert result["duration_s"] == result["last_event_s"] < took
    assert result["output_throughput"] == pytest.approx(14 / result["last_event_s"])
    assert result["request_throughput"] == pytest.approx(4 / result["last_event_s"])
    assert not result["blocked_in_run"] and all(r.closed for r in engine.submitted)


def test_genai_deadline_stops_a_slow_run():
    items = stub_items([1000, 1000, 1000])
    result, took, _ = run_stub_genai({"delay": 0.01}, items, deadline=0.6, stall=10.0)
    assert 0.6 <= took < 3.0
    assert result["stalled"] and result["stopped_by"] == "deadline"
    assert result["unfinished_requests"] == 3 and 0 < result["output_tokens"] < 3000
    assert result["deadline_s"] == 0.6 and result["stall_timeout_s"] == 10.0


def test_genai_run_that_never_returns_is_left_behind():
    items = stub_items([4, 4])
    MADE.clear()
    try:
        result, took, engine = run_stub_genai({"block_at": 4}, items, stall=0.4)
        assert took < 0.4 * 2 + 5.0 and result["blocked_in_run"]
        assert result["stalled"] and result["stopped_by"] == "stall"
        assert 0 < result["output_tokens"] < 8 and result["unfinished_requests"] == 2
    finally:
        for engine in MADE:
            engine.release.set()


def test_a_gap_between_arrivals_is_not_a_stall():
    """Nothing in flight during a gap of Poisson arrivals longer than the stall timeout."""
    items = stub_items([2, 2], arrivals=[0.0, 0.8])
    result, took, _ = run_stub_genai({}, items, stall=0.3)
    assert not result["stalled"] and result["completed"] == 2 and took >= 0.8


def test_summarize_and_the_table_take_a_run_without_tokens():
    items = stub_items([4, 4])
    result = bench.summarize(items, [bench.Record(), bench.Record()], 0.0)
    assert result["output_throughput"] == result["request_throughput"] == 0.0
    assert result["ttft_ms"]["p50"] is None and result["max_concurrent_decoding"] == 0
    result.update(requests=2, stalled=True, stopped_by="deadline", unfinished_requests=2,
                  last_event_s=None)  # fmt: skip
    table = bench.table({"genai-paged": result})
    assert "| 0.00 | 0.0 | - | - | - |" in table
    assert "| 2 of 2 unfinished with no event (deadline) |" in table


class StubServeEngine:
    """The Engine surface _run_engine uses: each request's events delivered inside submit(), all
    of them, or none for the `silent` ones (by submission order; the warm-up is -1)."""

    def __init__(self, silent=()):
        self.silent, self.submitted, self.cancelled = silent, 0, []

    def submit(self, prompt, params, on_event):
        from ort_kvlayout.serve.engine import Event

        index, self.submitted = self.submitted - 1, self.submitted + 1
        if index not in self.silent:
            for k in range(params.max_tokens):
                last = k == params.max_tokens - 1
                on_event(Event(index, 20 + k, None, "length" if last else None))
        return SimpleNamespace(cancel=lambda: self.cancelled.append(index))

    def stats(self):
        counters = dict.fromkeys(
            ["kv_peak_committed_bytes", "kv_reserved_bytes", "peak_running", "preemptions",
             "kv_bytes_moved", "graph_captures", "graph_replays", "decode_bucket_calls",
             "decode_padded_rows", "decode_eager_fallbacks", "kv_budget_bytes", "steps"], 0,
        )  # fmt: skip
        return counters | {"step_profile": {"decode_ms": 1.5}}


def test_the_engine_run_cancels_what_a_stall_left_unfinished():
    pytest.importorskip("ort_kvlayout.serve.engine")
    engine = StubServeEngine(silent=(1, 2))
    start = time.perf_counter()
    result = bench._run_engine(engine, stub_items([3, 5, 2, 4]), 30.0, 0.4)
    assert time.perf_counter() - start < 0.4 + 5.0
    assert sorted(engine.cancelled) == [1, 2]
    assert result["stalled"] and result["stopped_by"] == "stall"
    assert result["unfinished_requests"] == 2 and result["output_tokens"] == 7
    assert result["step_profile"] == {"decode_ms": 1.5}  # copied through


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("packing", ["auto", "mixed"])
@pytest.mark.parametrize("overlap", ["auto", "off"])
@pytest.mark.parametrize("ahead", ["auto", "on"])
def test_host_sampling_packing_and_overlap_ask_the_config_only_when_given(
    monkeypatch, host, packing, overlap, ahead
):
    engine_module = pytest.importorskip("ort_kvlayout.serve.engine")
    seen = {}

    def config(**kwargs):
        seen.update(kwargs)
        return SimpleNamespace(**kwargs)

    monkeypatch.setattr(engine_module, "EngineConfig", config)
    variant = bench.EngineVariant(
        64, "growable", "device", Path("m"), packing=packing, overlap=overlap, commit_ahead=ahead
    )
    args = argparse.Namespace(
        host_sampling=host, max_batch=2, variant=variant, provider="cpu",
        kv_budget=None, no_cuda_graph=False, capacity=None,
    )  # fmt: skip
    bench.engine_config(args, 4)
    assert ("sample_on_device" in seen) == host and seen.get("sample_on_device", False) is False
    assert ("packed" in seen) == (packing != "auto")
    if packing == "mixed":
        assert seen["packed"] is True and seen["mixed"] is True
    assert seen.get("overlap", "unset") == ("unset" if overlap == "auto" else False)
    assert seen.get("commit_ahead", "unset") == ("unset" if ahead == "auto" else True)


def test_the_engine_deadline_on_a_tiny_model(tmp_path):
    """A real engine: long outputs one slot at a time past a short deadline; the run returns,
    with the tokens made before it, and the engine ends the cancelled requests."""
    from ort_kvlayout.serve.engine import Engine, EngineConfig
    from ort_kvlayout.tools.patch import patch_model_dir
    from serve_util import library_or_skip
    from synthetic_models import Variant, make_model_dir

    library_or_skip()
    src = make_model_dir(tmp_path / "original", Variant(layers=2))
    model = patch_model_dir(src, tmp_path / "seq", layout="seq-major").out_dir
    # 3840 steps one slot at a time (about 0.7 s on a laptop core) against a 0.1 s deadline
    items = [bench.Item([5 + i, 7, 9, 11], 240, 0.0) for i in range(16)]
    with Engine(model, EngineConfig(max_batch=1)) as engine:
        start = time.perf_counter()
        result = bench._run_engine(engine, items, 0.1, 30.0)
        assert time.perf_counter() - start < 0.1 + 5.0
        assert result["stalled"] and result["stopped_by"] == "deadline"
        assert result["unfinished_requests"] >= 8 and 0 < result["output_tokens"] < 3840
        assert result["duration_s"] == result["last_event_s"] < 0.2  # the tokens before it
        deadline = time.monotonic() + 10
        while engine.stats()["running"] + engine.stats()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats()["running"] == engine.stats()["waiting"] == 0  # cancelled


class StubCompletions(http.server.BaseHTTPRequestHandler):
    """/v1/completions streaming one token a frame; max_tokens 99: one frame, then silence."""

    release = threading.Event()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for k in range(1 if n == 99 else n):
            reason = "length" if k == n - 1 else None
            frame = {"choices": [{"token_ids": [20 + k], "finish_reason": reason}]}
            self.wfile.write(f"data: {json.dumps(frame)}\n\n".encode())
            self.wfile.flush()
        if n == 99:
            self.release.wait(30)
            return
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_the_server_clients_stop_at_a_stall():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StubCompletions)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run = bench.Run(stub_items([3, 99, 4]), 30.0, 0.4)
        start = time.perf_counter()
        bench._run_clients(run, server.server_address[1])
        assert time.perf_counter() - start < 0.4 + 5.0
        result = run.result()
        assert result["stalled"] and result["stopped_by"] == "stall"
        assert result["unfinished_requests"] == 1 and result["output_tokens"] == 3 + 1 + 4
    finally:
        StubCompletions.release.set()
        server.shutdown()


def test_process_cpu_counts_a_tree_by_group_and_the_table_renders_it():
    """process_cpu: this process's CPU (a command line of no known group: "ray", the rest of a
    Ray cluster), and what a later call adds; cpu_note: ms a token by group under the table."""
    import os
    import subprocess
    import sys

    pytest.importorskip("psutil")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = bench.process_cpu(os.getpid())
        assert set(before) == {"ray", "_by_pid"} and child.pid in before["_by_pid"]
        deadline = time.process_time() + 0.2
        while time.process_time() < deadline:  # spend 0.2 s of CPU here
            pass
        spent = bench.process_cpu(os.getpid(), since=before)
        assert set(spent) == {"ray"} and spent["ray"] >= 0.15
    finally:
        child.kill()
        child.wait()
    assert bench.process_cpu(2**22 + 12345) is None  # no such process
    result = bench.summarize(stub_items([4, 4]), [bench.Record(), bench.Record()], 1.0)
    result.update(output_tokens=1000, cpu_s={"engine replica": 0.5, "ingress": 0.25})
    table = bench.table({"cluster (1 replica)": result})
    assert "CPU of the served system's processes" in table
    assert (
        "- cluster (1 replica): 0.750 CPU ms a token (engine replica 0.500, ingress 0.250)" in table
    )
