"""Serving benchmark: one seeded workload through our engine and through onnxruntime-genai.

    python bench/bench_serving.py --model SEQ_MAJOR_DIR --genai-model ORIGINAL_DIR \\
        --num-requests 16 --input-len 128 --output-len 64 --request-rate inf --max-batch 4

Methods and metric names follow vLLM's `bench serve` and SGLang's bench_serving:

* Workload (seeded): N requests; input lengths uniform in [L(1-r), L(1+r)] (`--input-len`,
  `--range-ratio`; `--dataset random`), or a named workload (`--dataset long`: the long-context
  mix, prompts uniform in [8192, 32768] tokens and outputs uniform in [128, 512]; `--dataset
  chat`: short chats, prompts uniform in [64, 512], outputs uniform in [64, 512]); `--input-range
  LO,HI` / `--output-range LO,HI` replace either range (small CPU runs of a named workload);
  prompts are clipped to the context minus their output; prompt tokens drawn uniformly from the
  vocabulary (throughput does not depend on the tokens' values); every request ignores EOS,
  so each produces exactly its output length. Arrivals all at once (`--request-rate inf`) or
  Poisson at that rate (requests/s). `--dry-run` prints the workload and runs nothing.
* Systems, on the same prompts: `engine` (ort_kvlayout.serve.engine on the patched model, in
  process: iteration-level scheduling over a growable seq-major cache), `server` (the same
  engine behind `ort-kvlayout serve`, started by the script, through streamed HTTP requests),
  `cluster` (the same server with `--replicas N` for each N of `--replicas 1,2`: N engines
  through Ray Serve, each with its share of the cores; the cluster extra),
  `genai` (onnxruntime-genai's og.Engine on `--genai-model`, the builder's plain GQA model:
  requests through begin_turn, events from run; it batches statically, up to its configured
  batch, and a late request waits for the batch in flight; all it does on CPU) and
  `genai-paged` (og.Engine on `--genai-paged-model`, built with the builder's
  `use_paged_attention=true`: continuous batching over PagedAttention, CUDA fp16/bf16 only;
  with `--kv-budget` its block pool is pinned to the same bytes, `num_blocks` = budget /
  (block_size x KV bytes per token), and its batch to `--max-batch`).
* Models: `--model-shape llama-3.2-1b|llama-3.1-8b` builds fp16 (CUDA) models of those shapes
  with random weights (a Hugging Face folder written by transformers, N(0, 0.02) weights, then
  onnxruntime-genai's builder: the plain GQA model, the paged one on CUDA, and the seq-major
  patch of the first), cached under `--build-dir`; throughput does not depend on the weights'
  values, the tokens do not matter. `tiny-llama` is a 2-layer shape for tests.
* Metrics: request throughput (req/s), output-token throughput (tok/s), total-token throughput,
  TTFT (arrival -> first token), TPOT ((last - first token) / (output - 1)), ITL (the gaps
  between a request's tokens), each as mean / p50 / p99 in ms; peak committed KV bytes and
  preemptions (engine); the most requests producing tokens at once (both, from the timelines).

* Stalls: each system's run has a deadline, `--deadline` seconds (default 900) from its start;
  it also stalls when no event of its requests came for `--stall-timeout` seconds (default 120)
  while some are unfinished, or when og.Engine holds no request while some of ours never ended.
  A stalled run stops waiting and records what it has: our engine's unfinished requests are
  cancelled, the HTTP clients' connections shut down, og.Engine's run() no longer called and its
  requests closed (og.Engine runs in a worker thread, so a run() that never returns is left
  behind: `blocked_in_run`). Its result says `stalled`, `stopped_by` (deadline, stall, idle,
  warm-up), `unfinished_requests` of `requests`, `last_event_s` (its last event, seconds after
  the start), `deadline_s` and `stall_timeout_s`; its metrics cover the tokens produced before
  the stall, and its throughputs (and `duration_s`) run to its last event, not to the moment
  it was given up on. og.Engine events whose request is None or not one of ours are counted
  (`stray_events`) and skipped. A table with a stalled run gets a `stalled` column.
* `--kv-quant none,int8-per-token,...`: the engine systems once per KV cache scheme, on the
  seq-major patch of `--genai-model` with that quantized cache (tools/kvquant.py; `none` is
  `--model`'s own cache), built beside the other models; at the same `--kv-budget`, the results
  show what each scheme holds (KV bytes, preemptions, `max_concurrency`).
* `--packing auto,off,on,mixed`, `--overlap auto,on,off`, `--commit-ahead auto,on,off`,
  `--pipeline auto,on,off` and `--prefill-wait auto,0,16`: the engine systems once per value
  (EngineConfig packed/mixed, and the engine system's overlap, commit_ahead, pipeline and
  prefill_wait; `auto` leaves the engine's
  default), each row labelled with it when a list gives several.
* `--host-sampling`: the engine system with EngineConfig(sample_on_device=False) (the system
  `engine-host` is that engine beside the default one in the same run); the engine
  result records `sample_on_device` (None where EngineConfig has no such field) and the engine's
  `step_profile` stats where it keeps them (as the engine counts them: warm-up included).

Prints a Markdown table and writes JSON (--json; default bench/results/serving-<device>.json)
with the device, commit, command and workload.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from revision import device_name, git_revision  # a sibling: bench/revision.py

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Item:
    prompt: list[int]
    output_len: int
    arrival: float  # seconds after the start


@dataclass
class Record:
    arrival: float = 0.0
    times: list[float] = field(default_factory=list)  # each token's time (seconds after start)
    done: bool = False  # ended by its output length (EOS is ignored: the expected end)
    ended: bool = False  # its last event came (or its stream closed), whatever the reason


# Named workloads: (prompt tokens, output tokens), each uniform on [lo, hi] (inclusive).
WORKLOADS = {
    "long": ((8192, 32768), (128, 512)),  # the long-context mix
    "chat": ((64, 512), (64, 512)),  # short chats
}


def length_ranges(args) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (lo, hi) ranges of prompt and output lengths the workload draws from."""
    if args.dataset in WORKLOADS:
        inputs, outputs = WORKLOADS[args.dataset]
    else:
        r = args.range_ratio
        inputs = (int(args.input_len * (1 - r)), int(args.input_len * (1 + r)))
        outputs = (int(args.output_len * (1 - r)), int(args.output_len * (1 + r)))
    inputs = args.input_range or inputs
    outputs = args.output_range or outputs
    return (max(inputs[0], 1), max(inputs[1], 1)), (max(outputs[0], 1), max(outputs[1], 1))


def workload(args, vocab: int, context: int) -> list[Item]:
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    (ilo, ihi), (olo, ohi) = length_ranges(args)
    inputs = rng.integers(ilo, ihi + 1, n)
    outputs = rng.integers(olo, ohi + 1, n)
    outputs = np.minimum(outputs, context - 1)
    inputs = np.maximum(np.minimum(inputs, context - outputs), 1)  # clipped to the context
    if np.isinf(args.request_rate):
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / args.request_rate, n))
        arrivals -= arrivals[0]
    # Token ids above the first 16 (SmolLM2's special tokens sit there).
    return [
        Item(rng.integers(16, vocab, int(i)).tolist(), int(o), float(a))
        for i, o, a in zip(inputs, outputs, arrivals)
    ]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99))}  # fmt: skip


def summarize(items: list[Item], records: list[Record], duration: float) -> dict:
    ttft, tpot, itl = [], [], []
    out_tokens = sum(len(r.times) for r in records)
    in_tokens = sum(len(i.prompt) for i in items)
    # Prompts that were served (a first token came): all of them unless the run stalled.
    prefilled = sum(len(i.prompt) for i, r in zip(items, records) if r.times)
    for r in records:
        if not r.times:
            continue
        ttft.append(r.times[0] - r.arrival)
        if len(r.times) > 1:
            tpot.append((r.times[-1] - r.times[0]) / (len(r.times) - 1))
            itl += list(np.diff(r.times))
    events = sorted([(r.times[0], 1) for r in records if r.times]
                    + [(r.times[-1], -1) for r in records if r.times])  # fmt: skip
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    # A run stopped before its first event has no time to divide by, and nothing to divide.
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return {
        "completed": sum(r.done for r in records),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": rate(sum(r.ended for r in records)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(prefilled + out_tokens),
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "max_concurrent_decoding": peak,
    }


DEADLINE_S = 900.0  # --deadline: a system's run stops waiting this long after its start
STALL_TIMEOUT_S = 120.0  # --stall-timeout: ... or this long without an event of its requests
# After a run stopped, how long the harness waits for a system's thread (og.Engine's worker,
# our engine's loop, the HTTP clients) to let go before it moves on without it.
CLOSE_GRACE_S = 30.0


class Run:
    """One system's pass over the workload: each request's Record, and when to stop waiting.

    Thread-safe: events come from the engine's thread, the HTTP clients' threads or og.Engine's
    worker while the caller waits. A run ends when every request ended; it stops (stalls) when
    `deadline` seconds passed since begin(), or when no event of ours came for `stall_timeout`
    seconds while submitted requests are unfinished (stray events, not of our requests, make no
    progress, so they do not count). Once stopped, its records are frozen: what came later does
    not count."""

    def __init__(self, items: list[Item], deadline: float, stall_timeout: float):
        self.items = items
        self.records = [Record() for _ in items]
        self.deadline = deadline
        self.stall_timeout = stall_timeout
        self.start = time.perf_counter()
        self.last_event: float | None = None  # seconds after start
        self.end: float | None = None  # when every request ended, or when the run stopped
        self.stopped_by: str | None = None  # "deadline", "stall", "idle", "warm-up", "error"
        self.stray_events = 0
        self._quiet_since = 0.0  # the later of the last event and the last arrival
        self._in_flight = 0
        self._ended = 0
        self._cond = threading.Condition()

    def begin(self) -> None:
        """Restarts the clock (after a warm-up in another thread)."""
        with self._cond:
            self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def arrive(self, i: int) -> bool:
        """Request i is being submitted now; False when the run already stopped."""
        with self._cond:
            if self.stopped:
                return False
            self.records[i].arrival = self._quiet_since = self.now()
            self._in_flight += 1
            return True

    def token(self, i: int, n: int = 1, at: float | None = None) -> None:
        """n tokens of request i, at `at` (seconds after start; default now)."""
        with self._cond:
            if not self.stopped:
                at = self.now() if at is None else at
                self.records[i].times += [at] * n
                self.last_event = self._quiet_since = at

    def finish(self, i: int, done: bool, at: float | None = None, event: bool = True) -> None:
        """Request i ended (done: by its length); event=False: its stream closed, no event."""
        with self._cond:
            record = self.records[i]
            if self.stopped or record.ended:
                return
            record.ended, record.done = True, done
            self._in_flight -= 1
            self._ended += 1
            if event:
                self.last_event = self._quiet_since = self.now() if at is None else at
            if self._ended == len(self.records):
                self.end = self.now()
            self._cond.notify_all()

    def stray(self) -> None:
        with self._cond:
            self.stray_events += 1

    def stop(self, reason: str) -> None:
        """Stops waiting (if requests are unfinished): the run stalled for `reason`."""
        with self._cond:
            if not self.stopped and self._ended < len(self.records):
                self.stopped_by, self.end = reason, self.now()
                self._cond.notify_all()

    def wait(self, until: float = float("inf")) -> bool:
        """Blocks until `until` (seconds after start; True: the run goes on) or the run is over
        (False): every request ended, or it stopped, here if its deadline or stall came."""
        with self._cond:
            while self._ended < len(self.records) and not self.stopped:
                now = self.now()
                reason, check = self._expiry(now)
                if reason is not None:
                    self.stop(reason)
                    break
                if now >= until:
                    return True
                self._cond.wait(min(check, until) - now)  # tokens do not notify: no wake-ups
            return False

    def _expiry(self, now: float) -> tuple[str | None, float]:
        """Why the run should stop now (or None), and when to look again."""
        if now >= self.deadline:
            return "deadline", now
        if self._in_flight == 0:
            return None, self.deadline
        stall = self._quiet_since + self.stall_timeout
        return ("stall", now) if now >= stall else (None, min(stall, self.deadline))

    def result(self) -> dict:
        """summarize() over the records, and how the run ended. A stalled run's throughput
        counts the tokens it produced over the time to its last event (the time it was making
        progress), not to the moment it was given up on."""
        with self._cond:
            duration = self.end if self.end is not None else self.now()
            if self.stopped and self.last_event is not None:
                duration = self.last_event
            result = summarize(self.items, self.records, duration)
            result.update(
                requests=len(self.records),
                stalled=self.stopped,
                stopped_by=self.stopped_by,
                unfinished_requests=len(self.records) - self._ended,
                last_event_s=self.last_event,
                deadline_s=self.deadline,
                stall_timeout_s=self.stall_timeout,
            )
        return result


@dataclass(frozen=True)
class EngineVariant:
    """One engine system of a run: its prefill chunk, cache, sampling ("device" or "host"),
    model, replicas (the cluster system), --packing value, and --overlap and --commit-ahead
    values (the engine system only: auto, on or off) and --prefill-wait (auto or steps)."""

    chunk: int | None  # None: the engine's default for the provider
    cache: str
    sampling: str
    model: Path
    replicas: int | None = None
    packing: str = "auto"
    overlap: str = "auto"
    commit_ahead: str = "auto"
    prefill_wait: str = "auto"
    pipeline: str = "auto"
    ingress: str = "auto"  # the cluster system: serve's --ingress (auto: its default)


def engine_config(args, n: int):
    from ort_kvlayout.serve.engine import EngineConfig

    kwargs = {}
    if args.host_sampling or args.variant.sampling == "host":
        # Only when asked: EngineConfigs older than the field would refuse the keyword.
        kwargs["sample_on_device"] = False
    if args.variant.packing != "auto":  # likewise: older engines have no packed calls
        from ort_kvlayout.serve.arguments import packing_fields

        kwargs.update(packing_fields(args.variant.packing))
    if args.variant.overlap != "auto":
        kwargs["overlap"] = args.variant.overlap == "on"
    if args.variant.commit_ahead != "auto":  # older engines have no such field
        kwargs["commit_ahead"] = args.variant.commit_ahead == "on"
    if args.variant.pipeline != "auto":  # likewise
        kwargs["pipeline"] = args.variant.pipeline == "on"
    if args.variant.prefill_wait != "auto":  # likewise
        kwargs["prefill_wait"] = int(args.variant.prefill_wait)
    try:
        return EngineConfig(
            max_batch=args.max_batch, prefill_chunk=args.variant.chunk, cache=args.variant.cache,
            provider=args.provider, kv_budget_bytes=args.kv_budget, max_waiting=n + 1,
            cuda_graph=False if args.no_cuda_graph else None,
            capacity=args.capacity, **kwargs,
        )  # fmt: skip
    except TypeError as exc:
        if kwargs:
            raise SystemExit(f"this engine has no {sorted(kwargs)} ({exc})")
        raise


def variant_model(args) -> Path:
    """The model of this engine variant: a --kv-quant scheme's patch, or --model."""
    return args.variant.model


def kv_quant_models(args, schemes: list[str]) -> dict[str, Path]:
    """Per --kv-quant scheme, its seq-major patch of --genai-model (built once, beside the
    other models, weights hard-linked); `none` is --model itself."""
    from ort_kvlayout.tools.kvquant import KV_QUANT_SCHEMES

    models = {}
    for scheme in schemes:
        if scheme == "none":
            models[scheme] = args.model
            continue
        if scheme not in KV_QUANT_SCHEMES:
            raise SystemExit(
                f"--kv-quant {scheme!r}: expected none or one of {', '.join(KV_QUANT_SCHEMES)}"
            )
        root = args.build_dir or default_build_dir()
        out = root / f"{args.genai_model.name}-seq-major-{scheme}"
        if not (out / ".complete").is_file():
            from ort_kvlayout.tools.patch import patch_model_dir

            print(f"patching {out} (seq-major, {scheme} KV cache)", file=sys.stderr)
            patch_model_dir(args.genai_model, out, layout="seq-major", kv_quant=scheme,
                            force=True, link=True)  # fmt: skip
            (out / ".complete").write_text(f"{args.genai_model.name}: {scheme}\n")
        models[scheme] = out
    return models


def run_engine(args, items: list[Item]) -> dict:
    from ort_kvlayout.serve.engine import Engine

    config = engine_config(args, len(items))
    engine = Engine(variant_model(args), config)
    try:
        result = _run_engine(engine, items, args.deadline, args.stall_timeout)
    finally:
        # Bounded: a step that never returns must not hang the harness (the loop's thread is a
        # daemon; the cache is then left to the process's end).
        engine.close(timeout=CLOSE_GRACE_S)
    result["sample_on_device"] = getattr(config, "sample_on_device", None)
    result["model"] = variant_model(args).name
    return result


def _warm_up(engine, prompt: list[int], timeout: float) -> None:
    from ort_kvlayout.serve.engine import RequestParams

    ended = threading.Event()
    params = RequestParams(max_tokens=2, ignore_eos=True)
    engine.submit(prompt, params, on_event=lambda e: e.finished and ended.set())
    if not ended.wait(timeout):
        raise RuntimeError(f"the engine's warm-up request did not end in {timeout} s")


def _run_engine(engine, items: list[Item], deadline: float, stall_timeout: float) -> dict:
    """items through a started Engine (events by callback on its thread); once the run stops,
    its unfinished requests are cancelled."""
    from ort_kvlayout.serve.engine import RequestParams

    _warm_up(engine, items[0].prompt[:8], stall_timeout)
    warm = engine.stats()
    run = Run(items, deadline, stall_timeout)

    def on_event(i):
        def cb(event):
            if event.token_id is not None:
                run.token(i)
            if event.finished:
                run.finish(i, event.finish_reason == "length")

        return cb

    handles = {}
    for i, item in enumerate(items):
        if not run.wait(until=item.arrival) or not run.arrive(i):
            break
        params = RequestParams(max_tokens=item.output_len, ignore_eos=True)
        handles[i] = engine.submit(item.prompt, params, on_event=on_event(i))
    run.wait()
    if run.stopped:
        for i, handle in handles.items():
            if not run.records[i].ended:
                handle.cancel()
    stats = engine.stats()
    result = run.result()
    result.update(
        peak_committed_kv_bytes=stats["kv_peak_committed_bytes"],
        reserved_kv_bytes=stats["kv_reserved_bytes"],
        max_concurrency=stats["peak_running"],
        preemptions=stats["preemptions"] - warm["preemptions"],
        kv_bytes_moved=stats["kv_bytes_moved"],
        graph_captures=stats["graph_captures"],
        graph_replays=stats["graph_replays"] - warm["graph_replays"],
        decode_buckets=stats["decode_bucket_calls"],
        decode_padded_rows=stats["decode_padded_rows"] - warm["decode_padded_rows"],
        decode_eager_fallbacks=stats["decode_eager_fallbacks"],
        kv_budget_bytes=stats["kv_budget_bytes"],
        engine_steps=stats["steps"] - warm["steps"],
        prefill_calls=stats.get("prefill_calls", 0) - warm.get("prefill_calls", 0),
        admission_holds=stats.get("admission_holds", 0) - warm.get("admission_holds", 0),
    )
    # Per-phase step times, where the engine keeps them, copied as they are: counted since the
    # engine started, so the warm-up request's steps are in them.
    if "step_profile" in stats:
        result["step_profile"] = stats["step_profile"]
    return result


def run_server(args, items: list[Item]) -> dict:
    """The same workload through `ort-kvlayout serve` (started here on a free port) over HTTP,
    after an untimed burst of --max-batch requests a replica (_warm_burst):
    streamed /v1/completions with the prompt as token ids, ignore_eos, greedy; a token's time is
    when its SSE frame arrives (return_token_ids counts the tokens of each frame). Once the run
    stops, the clients' connections are shut down (the server is terminated anyway)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    chunk, cache = args.variant.chunk, args.variant.cache
    cmd = [sys.executable, "-m", "ort_kvlayout.serve.cli", "serve", str(variant_model(args)),
           "--port", str(port), "--max-batch", str(args.max_batch),
           "--cache", cache, "--provider", args.provider,
           "--max-waiting", str(len(items) + 1), "--model-id", "bench"]  # fmt: skip
    if chunk is not None:
        cmd += ["--prefill-chunk", str(chunk)]
    if args.kv_budget:
        cmd += ["--kv-budget", str(args.kv_budget)]
    if args.variant.packing != "auto":
        cmd += ["--packing", args.variant.packing]
    if args.variant.replicas:  # system cluster: that many replicas through Ray Serve
        cmd += ["--replicas", str(args.variant.replicas)]
        if args.gpus_per_replica:  # replicas sharing a GPU (with --kv-budget in bytes)
            cmd += ["--gpus-per-replica", str(args.gpus_per_replica)]
        if args.variant.ingress != "auto":
            cmd += ["--ingress", args.variant.ingress]
    launched = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _await_server(proc, port, items[0].prompt[:8])
        ready = time.monotonic() - launched
        _warm_burst(port, items, args.max_batch * (args.variant.replicas or 1))
        before = process_cpu(proc.pid)
        run = Run(items, args.deadline, args.stall_timeout)
        _run_clients(run, port)
        cpu = process_cpu(proc.pid, since=before)
        metrics = _server_metrics(port)
    finally:
        proc.terminate()
        proc.wait(60)
    result = run.result()
    result["ready_s"] = round(ready, 2)
    if cpu is not None:
        result["cpu_s"] = cpu
    result.update(
        peak_committed_kv_bytes=_int(metrics.get("kv_committed_bytes_peak")),
        max_concurrency=_int(metrics.get("requests_running_peak")),
        preemptions=_int(metrics.get("preemptions_total")),
        kv_bytes_moved=_int(metrics.get("kv_bytes_moved_total")),
    )
    return result


# A served system's processes by what they are: the first name found in a process's command
# line (Ray titles its workers, e.g. "ray::ServeReplica:ort-kvlayout:EngineReplica").
PROCESS_GROUPS = (
    ("EngineReplica", "engine replica"), ("OpenAIIngress", "ingress"), ("ProxyActor", "proxy"),
    ("ServeController", "controller"), ("haproxy", "haproxy"), ("ort_kvlayout.serve.cli", "serve cli"),
)  # fmt: skip


def process_cpu(pid: int, since: dict | None = None) -> dict[str, float] | None:
    """CPU seconds (user + system) of process `pid` and its descendants (a local Ray cluster's
    own processes among them), summed by PROCESS_GROUPS ("ray" for the rest); with `since`,
    those spent after that earlier call ("_by_pid" keeps what the difference needs). None
    without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    by_pid = {}
    for p in procs:
        try:
            t = p.cpu_times()
            line = " ".join(p.cmdline()) or p.name()
        except psutil.Error:  # ended meanwhile
            continue
        group = next((g for key, g in PROCESS_GROUPS if key in line), "ray")
        by_pid[p.pid] = (group, t.user + t.system)
    earlier = (since or {}).get("_by_pid", {})
    out: dict = {}
    for ident, (group, seconds) in by_pid.items():
        spent = seconds - earlier.get(ident, (group, 0.0))[1]
        out[group] = out.get(group, 0.0) + spent
    out = {g: round(v, 3) for g, v in sorted(out.items())}
    return out if since is not None else {**out, "_by_pid": by_pid}


def ready_note(results: dict) -> str | None:
    """How long each served system took from its launch to its first answered request (the
    median of its runs), or None where none was served."""
    parts = []
    for name, r in results.items():
        runs = r.get("runs_ready_s") or ([r["ready_s"]] if "ready_s" in r else [])
        if runs:
            parts.append(f"{name} {sorted(runs)[len(runs) // 2]:.1f} s")
    if not parts:
        return None
    return "Launch to the first answered request (median of the runs): " + ", ".join(parts) + "."


def cpu_note(results: dict) -> list[str]:
    """A line per served system that recorded its processes' CPU: ms per output token, by
    process."""
    lines = []
    for name, r in results.items():
        cpu, tokens = r.get("cpu_s"), r.get("output_tokens")
        if not cpu or not tokens:
            continue
        total = sum(cpu.values())
        parts = ", ".join(f"{g} {1000 * v / tokens:.3f}" for g, v in cpu.items() if v >= 0.0005)
        lines.append(f"- {name}: {1000 * total / tokens:.3f} CPU ms a token ({parts})")
    return lines


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _completion(item: Item) -> dict:
    return {"model": "bench", "prompt": item.prompt, "max_tokens": item.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}  # fmt: skip


def _post(port: int, body: dict, on_line=None, sockets: list | None = None) -> None:
    """POSTs a completion and feeds each SSE data line to on_line; its socket goes to
    `sockets` (so that another thread can shut it down)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        if sockets is not None:
            sockets.append(conn.sock)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if on_line is not None and line.startswith(b"data: {"):
                on_line(json.loads(line[6:]))
    finally:
        conn.close()


def _await_server(proc: subprocess.Popen, port: int, prompt: list[int]) -> None:
    """Until a warm-up request answers (at most 300 s)."""
    deadline = time.monotonic() + 300
    while True:
        try:
            _post(port, _completion(Item(prompt, 2, 0.0)))
            return
        except (OSError, RuntimeError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {proc.stderr.read()}") from None
            time.sleep(0.2)


def _warm_burst(port: int, items: list[Item], n: int) -> None:
    """n requests at once, 8 tokens each, untimed: every slot of every replica, and Ray's
    path, have served before the run (a cluster's first seconds are its start-up's)."""
    threads = [
        threading.Thread(
            target=_post, args=(port, _completion(Item(items[i % len(items)].prompt, 8, 0.0)))
        )
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    time.sleep(1.0)


def _run_clients(run: Run, port: int) -> None:
    """One streaming client thread per request, each started at its arrival."""
    import http.client
    import socket

    sockets: list[socket.socket] = []

    def client(i: int) -> None:
        def on_line(frame: dict) -> None:
            at = run.now()
            for choice in frame.get("choices", []):
                if n := len(choice.get("token_ids") or []):
                    run.token(i, n, at)
                if choice.get("finish_reason"):
                    run.finish(i, choice["finish_reason"] == "length", at)

        try:
            if run.arrive(i):
                _post(port, _completion(run.items[i]), on_line, sockets)
        except (OSError, ValueError, http.client.HTTPException):
            if not run.stopped:  # a stopped run shut the connection down: expected
                raise
        finally:
            run.finish(i, False, event=False)  # a stream that closed without a finish_reason

    threads = []
    for i, item in enumerate(run.items):
        if not run.wait(until=item.arrival):
            break
        threads.append(threading.Thread(target=client, args=(i,), daemon=True))
        threads[-1].start()
    run.wait()
    if run.stopped:
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks the client reading it
            except OSError:
                pass
    for t in threads:
        t.join(CLOSE_GRACE_S)


def _server_metrics(port: int) -> dict[str, float]:
    """The server's /metrics (prefix dropped); empty if it does not answer (a stalled server)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():  # a cluster's replicas each have a line: summed
        if line and not line.startswith("#"):
            name = line.split("{")[0].removeprefix("ort_kvlayout_")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def genai_kv_token_bytes(model_dir: Path) -> int:
    """KV bytes per token of every layer (K and V) of an onnxruntime-genai model, fp16/bf16."""
    decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    heads, size = decoder["num_key_value_heads"], decoder["head_size"]
    return decoder["num_hidden_layers"] * 2 * heads * size * 2


def paged_with_budget(model_dir: Path, budget: int | None, max_batch: int, root: Path) -> tuple:
    """The paged model with its block pool pinned to `budget` bytes (num_blocks; otherwise the
    builder's gpu_utilization_factor stays) and its batch to max_batch: a folder of links to
    model_dir's files beside an edited genai_config.json. Returns (folder, pool bytes or None)."""
    config = json.loads((model_dir / "genai_config.json").read_text())
    batching = config.setdefault("engine", {}).setdefault("dynamic_batching", {})
    batching["max_batch_size"] = max_batch
    pool = None
    if budget is not None:
        block = batching.get("block_size", 256) * genai_kv_token_bytes(model_dir)
        batching.pop("gpu_utilization_factor", None)
        batching["num_blocks"] = max(budget // block, 1)
        pool = batching["num_blocks"] * block
    out = root / f"{model_dir.name}-blocks"
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        link = out / f.name
        if f.name != "genai_config.json" and not link.exists():
            link.symlink_to(f.resolve())
    (out / "genai_config.json").write_text(json.dumps(config, indent=1))
    return out, pool


def run_genai(args, items: list[Item], paged: bool = False) -> dict:
    import tempfile

    import onnxruntime_genai as og

    model_dir, pool = args.genai_model, None
    with tempfile.TemporaryDirectory() as tmp:
        if paged:
            model_dir, pool = paged_with_budget(
                args.genai_paged_model, args.kv_budget, args.max_batch, Path(tmp)
            )
        model = og.Model(str(model_dir))
        result = _run_genai(og, model, items, args.deadline, args.stall_timeout)
        del model
    result["kv_pool_bytes"] = pool
    return result


def _run_genai(
    og, model, items: list[Item], deadline: float = DEADLINE_S, stall: float = STALL_TIMEOUT_S
) -> dict:
    """items through og.Engine: requests by begin_turn, events from run(). og.Engine must be
    called from the thread that made it, so a worker thread makes and drives it while this one
    waits on the Run: a run() that never returns cannot hang the harness. Once the run stops,
    the worker stops calling run() and closes the requests; if run() has not returned
    CLOSE_GRACE_S (at most the stall timeout) later, the worker is left behind
    (`blocked_in_run`) with its requests open. The warm-up request must end within the stall
    timeout."""
    run = Run(items, deadline, stall)
    warmed, out = threading.Event(), {}
    worker = threading.Thread(target=_genai_worker, args=(og, model, run, warmed, out))
    worker.daemon = True  # one blocked in run() must not keep the process alive
    worker.start()
    if warmed.wait(stall):
        run.wait()
    else:
        run.stop("warm-up")
    worker.join(min(CLOSE_GRACE_S, stall))
    if "error" in out:
        raise out["error"]
    result = run.result()
    result.update(
        peak_committed_kv_bytes=None, max_concurrency=out.get("capacity"), preemptions=None,
        stray_events=run.stray_events, blocked_in_run=worker.is_alive(),
    )  # fmt: skip
    return result


def _genai_worker(og, model, run: Run, warmed: threading.Event, out: dict) -> None:
    """The worker of _run_genai: makes the engine, ends a warm-up request, then the run;
    closes its requests. out: "capacity" (its configured batch) or "error"."""
    requests = []
    try:
        engine = og.Engine(model)
        out["capacity"] = engine.get_capabilities().configured_max_batch_size
        buffer = engine.create_event_buffer(1024)
        requests.append(_genai_submit(og, engine, run.items[0].prompt[:8], 2))
        while engine.has_pending_requests() and not run.stopped:
            engine.run(buffer)
        run.begin()
        warmed.set()
        _genai_loop(og, engine, buffer, run, requests)
    except Exception as exc:  # noqa: BLE001 (re-raised by _run_genai, on its thread)
        out["error"] = exc
        run.stop("error")
    finally:
        warmed.set()
        for request in requests:
            request.close()


def _genai_submit(og, engine, prompt: list[int], n: int):
    request = engine.create_request()
    options = og.TurnOptions(request)
    options.set_max_generated_tokens(n)
    options.set_min_generated_tokens(n)  # EOS masked: exactly n tokens (ignore_eos)
    options.set_temperature(0.0)
    request.begin_turn(np.array(prompt, np.int32), options)
    return request


def _genai_loop(og, engine, buffer, run: Run, requests: list) -> None:
    """Submits each item at its arrival and feeds run()'s events to the Run until it is over.
    An event whose request is None or not one of ours is counted (stray_events) and skipped."""
    token_flag = og.EngineEventFlags.TOKEN.value
    by_request: dict[int, int] = {}  # id() of our requests (kept alive in `requests`) -> item

    def on_event(event, at: float) -> None:
        i = by_request.get(id(event.request)) if event.request is not None else None
        if i is None:
            run.stray()
            return
        if event.flags.value & token_flag:
            run.token(i, at=at)
        if event.finish_reason != og.FinishReason.NONE:
            run.finish(i, event.finish_reason == og.FinishReason.MAX_GENERATED_TOKENS, at)

    items, pending = run.items, 0  # items[pending:] are still to arrive
    while not run.stopped:
        while pending < len(items) and items[pending].arrival <= run.now():
            if not run.arrive(pending):
                return
            request = _genai_submit(og, engine, items[pending].prompt, items[pending].output_len)
            by_request[id(request)] = pending
            requests.append(request)
            pending += 1
        if engine.has_pending_requests():
            events = engine.run(buffer)
            at = run.now()  # one run() call's tokens come out together
            for event in events or []:
                on_event(event, at)
        elif pending < len(items):
            run.wait(until=items[pending].arrival)
        else:
            # og.Engine holds nothing more: every request ended, or some will never end.
            run.stop("idle")
            return


def mixed_cost(args) -> dict:
    """What a mixed call costs against separate calls: a decode row for each of --max-batch
    slots beside one prefill chunk of --mixed-chunk tokens, run as one right-padded (batch,
    chunk) call (GQA's query_seqlens shape, the model's own layout), as a (batch, 1) decode call
    plus a (1, chunk) prefill call (the engine unmixed), and as one packed call of batch + chunk
    tokens (the served graph's packed tokens: `--packing mixed`). Medians of --mixed-repeat
    runs, ms. The padded call is a first prompt of its shape (no past); the packed call's decode
    rows attend a past of one chunk, as the separate decode call's do."""
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    b, chunk = args.max_batch, args.mixed_chunk
    plain = Engine(args.model, EngineConfig(max_batch=b + 1, provider=args.provider,
                                            packed=False), start=False)  # fmt: skip
    packed = None
    try:
        packed = Engine(args.model, EngineConfig(max_batch=b + 1, provider=args.provider,
                                                 packed=True), start=False)  # fmt: skip
    except ValueError as exc:  # a graph that cannot be packed: that row is left out
        print(f"--mixed-cost: no packed call ({exc})", file=sys.stderr)
    try:
        for engine in (plain, packed):
            if engine is not None:
                engine.cache.ensure([chunk + 1] * (b + 1))
        rng = np.random.default_rng(args.seed)

        def ids(n: int) -> list[int]:
            return rng.integers(16, plain.spec.vocab_size, n).tolist()

        def padded(batch: int, width: int) -> None:
            tokens = np.array([ids(width) for _ in range(batch)], np.int64)
            # a first prompt of `width` tokens in every row (no past), its last token sampled
            plain.executor.run(0, tokens, [width] * batch, [width - 1] * batch, [None] * batch)

        def separate() -> None:
            decode = np.array([ids(1) for _ in range(b)], np.int64)
            plain.executor.run(0, decode, [chunk + 1] * b, [0] * b, [None] * b)
            padded(1, chunk)

        def mixed_packed() -> None:
            rows = [(ids(1), chunk) for _ in range(b)] + [(ids(chunk), 0)]
            packed.executor.run_packed(0, rows, [None] * (b + 1))

        calls = {"mixed_padded": lambda: padded(b, chunk), "separate": separate}
        if packed is not None:
            calls["mixed_packed"] = mixed_packed
        times: dict[str, list[float]] = {name: [] for name in calls}
        for rep in range(args.mixed_repeat + 1):  # the first round warms up
            for name, fn in calls.items():
                start = time.perf_counter()
                fn()
                if rep:
                    times[name].append((time.perf_counter() - start) * 1000)
    finally:
        plain.close()
        if packed is not None:
            packed.close()
    return {name: float(np.median(t)) for name, t in times.items()} | {"runs_ms": times}


def table(results: dict) -> str:
    header = (
        "| system | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms "
        "| peak KV MiB | max decoding | preemptions |"
    )
    rows = [
        header,
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def pair(d):
        return f"{d['p50']:.0f} / {d['p99']:.0f}" if d["p50"] is not None else "-"

    def opt(value, fmt="{}"):
        return "-" if value is None else fmt.format(value)

    stalled = any(r.get("stalled") for r in results.values())
    if stalled:  # the column only where a run stalled: older tables stay as they were
        rows[0] += " stalled |"
        rows[1] += "---|"
    for name, r in results.items():
        kv = r.get("peak_committed_kv_bytes")
        rows.append(
            f"| {name} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
            f"| {pair(r['ttft_ms'])} | {pair(r['tpot_ms'])} | {pair(r['itl_ms'])} "
            f"| {opt(None if kv is None else kv / 2**20, '{:.1f}')} "
            f"| {r['max_concurrent_decoding']} | {opt(r.get('preemptions'))} |"
            + (f" {stall_note(r)} |" if stalled else "")
        )
    if stalled:
        rows += ["", STALL_FOOTNOTE]
    if cpu := cpu_note(results):
        rows += ["", "CPU of the served system's processes, from its first request to its last:",
                 "", *cpu]  # fmt: skip
    if ready := ready_note(results):
        rows += ["", ready]
    return "\n".join(rows)


STALL_FOOTNOTE = (
    "A stalled run was given up at its deadline (--deadline), after --stall-timeout seconds "
    "without an event of its requests, or when its engine held no request while some had not "
    "ended (idle); its row counts the tokens it produced, over the time to its last event."
)


def stall_note(r: dict) -> str:
    """'7 of 64 unfinished at 40.1 s (stall)' for a stalled run (the time of its last event),
    '-' for one that ended."""
    if not r.get("stalled"):
        return "-"
    at = "with no event" if r["last_event_s"] is None else f"at {r['last_event_s']:.1f} s"
    return f"{r['unfinished_requests']} of {r['requests']} unfinished {at} ({r['stopped_by']})"


def int_pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO,HI") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= LO <= HI")
    return lo, hi


def describe(args, items: list[Item], context: int) -> str:
    """--dry-run: the workload as drawn."""
    (ilo, ihi), (olo, ohi) = length_ranges(args)
    ins = np.array([len(i.prompt) for i in items])
    outs = np.array([i.output_len for i in items])
    rate = "all at once" if np.isinf(args.request_rate) else f"Poisson, {args.request_rate} req/s"
    lines = [
        f"workload {args.dataset}: {len(items)} requests, seed {args.seed}, arrivals {rate}",
        (
            f"prompt tokens uniform on [{ilo}, {ihi}] (clipped to the context {context} minus "
            f"the output): min {ins.min()}, median {int(np.median(ins))}, max {ins.max()}, "
            f"sum {ins.sum()}"
        ),
        (
            f"output tokens uniform on [{olo}, {ohi}], EOS ignored: min {outs.min()}, "
            f"median {int(np.median(outs))}, max {outs.max()}, sum {outs.sum()}"
        ),
        f"last arrival {items[-1].arrival:.1f} s",
    ]
    return "\n".join(lines)


def genai_version() -> str | None:
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    return getattr(og, "__version__", None)


# Model shapes for --model-shape (Hugging Face LlamaForCausalLM configs; random weights), with
# the real models' 128k context: what a preallocating cache reserves per request.
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "bos_token_id": 128000, "eos_token_id": 128001, "attention_bias": False,
           "mlp_bias": False, "max_position_embeddings": 131072, "torch_dtype": "float16"}  # fmt: skip
SHAPES = {
    "llama-3.2-1b": _LLAMA3 | {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    "llama-3.1-8b": _LLAMA3 | {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    # SmolLM2-135M's shape (Llama architecture, its 8k context): issue 56's replicas sharing a GPU
    "smollm2-135m": _LLAMA3 | {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "bos_token_id": 0, "eos_token_id": 0, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "tie_word_embeddings": True,
    },
    # a 2-layer shape for the tests (vocab of the char tokenizer's size is not needed: ids only)
    "tiny-llama": _LLAMA3 | {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
    },
}  # fmt: skip


def default_build_dir() -> Path:
    root = os.environ.get("ORT_KVLAYOUT_CACHE")
    if root:
        return Path(root).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ort_kvlayout" / "models"


def _write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` tokens: what the builder asks transformers for. The
    benchmark sends token ids, so its vocabulary only has to be the model's size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2",
              "unk_token": "t0", "model_max_length": 1 << 20}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def build_shape(
    shape: str, provider: str, root: Path, log=print, drop_hf: bool = False,
    paged: bool = True,
) -> dict[str, Path]:  # fmt: skip
    """Random-weight models of `shape` under root (each step skipped when its `.complete`
    marker exists, so an interrupted build resumes): {"hf", "gqa", "seq-major"} and, on CUDA
    with `paged`, "paged" (og.Engine's peer model). fp16 on CUDA, fp32 on the CPU (the
    builder's paged model is CUDA-only). The seq-major patch hard-links the weights; drop_hf
    removes the Hugging Face folder once the builder's models exist (the 8B shape then takes
    two 16 GB copies, not four; one without the paged model)."""
    precision, ep = ("fp16", "cuda") if provider == "cuda" else ("fp32", "cpu")
    base = root / f"{shape}-random-{precision}-{ep}"
    out = {"hf": base.with_name(base.name + "-hf"), "gqa": base,
           "seq-major": base.with_name(base.name + "-seq-major")}  # fmt: skip
    if provider == "cuda" and paged:
        out["paged"] = base.with_name(base.name + "-paged")

    def done(path: Path) -> bool:
        return (path / ".complete").is_file()

    def mark(path: Path) -> None:
        (path / ".complete").write_text(f"{shape}: random weights N(0, 0.02)\n")

    config = SHAPES[shape]
    cache = root / ".builder-cache"
    builds = [("gqa", [])]
    if "paged" in out:
        builds.append(("paged", ["--extra_options", "use_paged_attention=true",
                                 "max_batch_size=256"]))  # fmt: skip
    if not done(out["hf"]) and not all(done(out[key]) for key, _ in builds):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        log(f"writing {out['hf']} (random weights)", file=sys.stderr)
        out["hf"].mkdir(parents=True, exist_ok=True)
        hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "torch_dtype"})
        torch.manual_seed(0)
        with torch.device("meta"):
            model = LlamaForCausalLM(hf_config)
        model = model.to_empty(device="cpu").to(torch.float16)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02)
        model.tie_weights()
        model.save_pretrained(out["hf"], safe_serialization=True)
        del model
        _write_tokenizer(out["hf"], config["vocab_size"])
        mark(out["hf"])
    for key, extra in builds:
        if done(out[key]):
            continue
        log(f"building {out[key]} (onnxruntime-genai builder)", file=sys.stderr)
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(out["hf"]),
               "-o", str(out[key]), "-p", precision, "-e", ep, "-c", str(cache), *extra]  # fmt: skip
        subprocess.run(cmd, check=True)
        mark(out[key])
    if not done(out["seq-major"]):
        from ort_kvlayout.tools.patch import patch_model_dir

        log(f"patching {out['seq-major']} (seq-major)", file=sys.stderr)
        # Hard links: the patch changes the graph, not the weights (an 8B model's 16 GB once).
        patch_model_dir(out["gqa"], out["seq-major"], layout="seq-major", force=True, link=True)
        mark(out["seq-major"])
    if drop_hf and out["hf"].exists():
        log(f"removing {out['hf']} (--drop-hf: the builder's models are built)", file=sys.stderr)
        shutil.rmtree(out["hf"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="the patched (seq-major) model")
    p.add_argument("--genai-model", type=Path, help="the model og.Engine runs (default --model)")
    p.add_argument("--genai-paged-model", type=Path,
                   help="the builder's use_paged_attention model (system genai-paged)")  # fmt: skip
    p.add_argument("--model-shape", choices=sorted(SHAPES),
                   help="build random-weight models of this shape (under --build-dir) and use "
                        "them for --model, --genai-model and --genai-paged-model")  # fmt: skip
    p.add_argument("--build-dir", type=Path, help="where --model-shape builds (default: "
                   "$ORT_KVLAYOUT_CACHE/models)")  # fmt: skip
    p.add_argument("--build-only", action="store_true", help="with --model-shape: build, stop")
    p.add_argument("--drop-hf", action="store_true",
                   help="with --model-shape: delete the Hugging Face folder once built from")  # fmt: skip
    p.add_argument("--no-paged", action="store_true",
                   help="with --model-shape on CUDA: skip the builder's paged model (the "
                        "genai-paged system's), for runs of the engine alone")  # fmt: skip
    p.add_argument("--systems", default="engine,genai",
                   help="engine,engine-host,server,cluster,genai,genai-paged (comma separated; "
                        "engine-host: sampled on the host; server: over HTTP; cluster: the "
                        "server's --replicas through Ray Serve)")  # fmt: skip
    p.add_argument("--replicas", default="1",
                   help="system cluster: engine replicas, one system per count (e.g. 1,2)")  # fmt: skip
    p.add_argument("--ingress", default="auto",
                   help="system cluster: serve's --ingress, one system each (e.g. haproxy,proxy)")  # fmt: skip
    p.add_argument("--gpus-per-replica", type=float,
                   help="system cluster on CUDA: GPUs per replica (0.5: two share one)")  # fmt: skip
    p.add_argument("--capacity", type=int, help="engine tokens per slot (default: the context)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="the engine's decode calls uncaptured on CUDA")  # fmt: skip
    p.add_argument("--dataset", choices=["random", *WORKLOADS], default="random",
                   help="random: --input-len/--output-len/--range-ratio; long: prompts U[8192, "
                        "32768], outputs U[128, 512]; chat: prompts U[64, 512], outputs "
                        "U[64, 512]")  # fmt: skip
    p.add_argument("--input-range", type=int_pair, help="LO,HI prompt tokens (uniform)")
    p.add_argument("--output-range", type=int_pair, help="LO,HI output tokens (uniform)")
    p.add_argument("--dry-run", action="store_true", help="print the workload; run nothing")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s; inf: all at once"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=4, help="engine slots (og.Engine CPU: 4)")
    p.add_argument("--prefill-chunk", default="auto",
                   help="engine chunk(s), e.g. 64,4096 (auto: the engine's default for the "
                        "provider)")  # fmt: skip
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu", help="the engine's")
    p.add_argument("--cache", default="growable", help="engine cache(s): growable,preallocated")
    p.add_argument("--overlap", default="auto",
                   help="the engine system's overlap(s) (EngineConfig.overlap): auto, on, off; "
                        "e.g. on,off")  # fmt: skip
    p.add_argument("--commit-ahead", default="auto",
                   help="the engine system's commit_ahead(s) (EngineConfig.commit_ahead): auto, "
                        "on, off; e.g. on,off")  # fmt: skip
    p.add_argument("--pipeline", default="auto",
                   help="the engine system's pipeline(s) (EngineConfig.pipeline: decode steps "
                        "planned during the last one's Run): auto, on, off; e.g. off,on")  # fmt: skip
    p.add_argument("--prefill-wait", default="auto",
                   help="the engine system's prefill_wait(s) (EngineConfig.prefill_wait: steps a "
                        "waiting prompt may be held for company): auto or steps; e.g. 0,16")  # fmt: skip
    p.add_argument("--packing", default="auto",
                   help="engine packing(s) (EngineConfig packed, mixed): auto, off, on, mixed; "
                        "e.g. off,on")  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="runs per system, in turn (median)")
    p.add_argument("--kv-budget", type=int, default=None, help="engine KV budget in bytes")
    p.add_argument("--deadline", type=float, default=DEADLINE_S,
                   help="seconds from a system's start after which its run stops waiting and "
                        "records what it has (stalled); default %(default)s")  # fmt: skip
    p.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT_S,
                   help="a run also stalls after this many seconds without an event while "
                        "requests are unfinished; default %(default)s")  # fmt: skip
    p.add_argument("--kv-quant", default="", metavar="SCHEMES",
                   help="engine runs per KV cache scheme: none,int8-per-token,...")  # fmt: skip
    p.add_argument("--host-sampling", action="store_true",
                   help="the engine system samples on the host (EngineConfig "
                        "sample_on_device=False)")  # fmt: skip
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--mixed-cost",
        action="store_true",
        help="only time one padded mixed call against separate decode + prefill calls",
    )
    p.add_argument("--mixed-chunk", type=int, default=64)
    p.add_argument("--mixed-repeat", type=int, default=5)
    args = p.parse_args(argv)
    for flag, allowed in (("overlap", ("auto", "on", "off")),
                          ("commit_ahead", ("auto", "on", "off")),
                          ("pipeline", ("auto", "on", "off")),
                          ("packing", ("auto", "off", "on", "mixed"))):  # fmt: skip
        bad = [v for v in getattr(args, flag).split(",") if v not in allowed]
        if bad:
            p.error(f"--{flag} {bad}: expected {', '.join(allowed)}")
    bad = [v for v in args.prefill_wait.split(",") if v != "auto" and not v.isdigit()]
    if bad:
        p.error(f"--prefill-wait {bad}: expected auto or a number of steps (0 or more)")
    if args.model_shape:
        built = build_shape(args.model_shape, args.provider, args.build_dir or default_build_dir(),
                            drop_hf=args.drop_hf, paged=not args.no_paged)  # fmt: skip
        args.model = args.model or built["seq-major"]
        args.genai_model = args.genai_model or built["gqa"]
        args.genai_paged_model = args.genai_paged_model or built.get("paged")
        if args.build_only:
            print(json.dumps({k: str(v) for k, v in built.items()}, indent=1))
            return 0
    if args.model is None:
        p.error("--model (or --model-shape) is required")
    args.genai_model = args.genai_model or args.model
    if args.mixed_cost:
        result = mixed_cost(args)
        print(
            f"batch {args.max_batch} decode rows + one {args.mixed_chunk}-token chunk: one padded "
            f"call {result['mixed_padded']:.1f} ms, separate calls {result['separate']:.1f} ms"
            + (f", one packed call {result['mixed_packed']:.1f} ms" if "mixed_packed" in result
               else "")
        )  # fmt: skip
        if args.json:
            record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "device": device_name(args.provider), "commit": git_revision(mark_dirty=False),
                      "command": "python bench/bench_serving.py " + " ".join(argv or sys.argv[1:]),
                      "mixed_cost": result}  # fmt: skip
            args.json.write_text(json.dumps(record, indent=1) + "\n")
        return 0

    from ort_kvlayout.runtime.model_spec import ModelSpec

    spec = ModelSpec.from_dir(args.model)
    context = args.capacity or spec.kv.context_length
    items = workload(args, spec.vocab_size, context)
    ranges = length_ranges(args)
    if args.dry_run:
        print(describe(args, items, context))
        return 0
    # Each system (and each engine prefill chunk) runs --repeat times, in turn, so that a
    # shared machine's load changes hit them alike; the run of median output throughput counts.
    systems = []
    schemes = args.kv_quant.split(",") if args.kv_quant else ["none"]
    quant_models = kv_quant_models(args, schemes)
    for name in args.systems.split(","):
        if name in ("engine", "engine-host", "server", "cluster"):
            fn = run_server if name in ("server", "cluster") else run_engine
            sampling = "host" if name == "engine-host" else "device"
            counts = args.replicas.split(",") if name == "cluster" else [None]
            overlaps = args.overlap.split(",") if name == "engine" else ["auto"]
            aheads = args.commit_ahead.split(",") if name == "engine" else ["auto"]
            waits = args.prefill_wait.split(",") if name == "engine" else ["auto"]
            pipes = args.pipeline.split(",") if name == "engine" else ["auto"]
            ingresses = args.ingress.split(",") if name == "cluster" else ["auto"]
            for scheme, cache, chunk, count, packing, overlap, ahead, wait, pipe, ingress in (
                itertools.product(
                    schemes, args.cache.split(","), args.prefill_chunk.split(","), counts,
                    args.packing.split(","), overlaps, aheads, waits, pipes, ingresses,
                )
            ):  # fmt: skip
                notes = [f"chunk {chunk}"] if "," in args.prefill_chunk else []
                notes += [f"packing {packing}"] if "," in args.packing else []
                notes += [f"overlap {overlap}"] if len(overlaps) > 1 else []
                notes += [f"commit ahead {ahead}"] if len(aheads) > 1 else []
                notes += [f"prefill wait {wait}"] if len(waits) > 1 else []
                notes += [f"pipeline {pipe}"] if len(pipes) > 1 else []
                notes += [cache] if "," in args.cache else []
                notes += [f"{scheme} KV"] if args.kv_quant and scheme != "none" else []
                base = "engine" if name == "engine-host" else name
                notes += ["host sampling"] if name == "engine-host" else []
                notes += [f"{count} replica{'s' * (count != '1')}"] if count else []
                notes += [f"{ingress} ingress"] if len(ingresses) > 1 else []
                label = f"{base} ({', '.join(notes)})" if notes else base
                chunk = None if chunk == "auto" else int(chunk)
                variant = EngineVariant(chunk, cache, sampling, quant_models[scheme],
                                        int(count) if count else None, packing,
                                        overlap, ahead, wait, pipe, ingress)  # fmt: skip
                systems.append((label, fn, variant))
        elif name in ("genai", "genai-paged"):
            paged = name == "genai-paged"
            systems.append((name, lambda a, i, paged=paged: run_genai(a, i, paged), None))
        else:
            raise SystemExit(
                f"unknown system {name!r}: engine, engine-host, server, cluster, genai, genai-paged"
            )
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in systems}
    for rep in range(args.repeat):
        for label, fn, variant in systems:
            print(f"running {label} ({len(items)} requests, run {rep + 1})...", file=sys.stderr,
                  flush=True)  # fmt: skip
            args.variant = variant
            runs[label].append(fn(args, items))
    results = {}
    for label, rs in runs.items():
        in_order = [r["output_throughput"] for r in rs]  # round by round, as the systems took turns
        rs = sorted(rs, key=lambda r: r["output_throughput"])
        results[label] = dict(rs[len(rs) // 2])
        results[label]["runs_output_throughput"] = [r["output_throughput"] for r in rs]
        results[label]["runs_in_order"] = in_order
        if any("ready_s" in r for r in rs):
            results[label]["runs_ready_s"] = [r.get("ready_s") for r in runs[label]]
    for peer in ("genai", "genai-paged"):
        if "engine" in results and peer in results:
            theirs = results[peer]["output_throughput"]  # 0: a peer that stalled before a token
            ratio = results["engine"]["output_throughput"] / theirs if theirs else None
            results["engine"][f"output_throughput_vs_{peer.replace('-', '_')}"] = ratio
    print(table(results))
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device_name(args.provider),
        "commit": git_revision(mark_dirty=False),
        "command": "python bench/bench_serving.py " + " ".join(argv or sys.argv[1:]),
        "model": str(args.model.name),
        "genai_model": str(args.genai_model.name),
        "genai_paged_model": args.genai_paged_model.name if args.genai_paged_model else None,
        "genai_version": genai_version(),
        "model_shape": args.model_shape,
        "weights": "random N(0, 0.02)" if args.model_shape else "the model's own",
        "workload": {
            k: v for k, v in vars(args).items()
            if k not in ("model", "genai_model", "genai_paged_model", "json", "variant",
                         "build_dir")
        } | {"input_range": list(ranges[0]), "output_range": list(ranges[1])},
        "results": results,
    }  # fmt: skip
    record["workload"]["request_rate"] = str(args.request_rate)
    path = args.json or ROOT / "bench" / "results" / f"serving-{args.provider}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
