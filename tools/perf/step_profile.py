#!/usr/bin/env python3
"""Where a serving step's time goes: the engine's host phases against the GPU's busy time.

    python tools/perf/step_profile.py MODEL_DIR --provider cuda --batch 64 --prompt 256 \\
        --output 128 --modes device,host [--overlap on,off] [--no-cuda-graph] [--cprofile 25] \\
        [--json out.json]

`--batch` requests of `--prompt` random tokens each arrive at once and generate `--output`
tokens (EOS ignored), with `--max-batch` = batch slots, one mode after the other in one process.
`--requests N` sends N requests at once instead (more than the slots: slots turn over, as in a
serving burst), and `--prompt A:B` / `--output A:B` draw each request's lengths uniformly, e.g.
the chat burst of docs/SERVING.md: `--batch 64 --requests 256 --prompt 64:512 --output 64:512`.
The modes:
`device` is the served graph (tokens sampled on the device, only ids copied back; a call per
prefill chunk), `packed` the same with packed tokens (a step's chunks in one call), `mixed` with
the decode rows in that call too, `host` the model's own graph (all logits copied back and
sampled on the host); `--overlap` runs each mode
with the engine's overlap on and off (EngineConfig.overlap; default: the engine's choice), and
`--commit-ahead` with EngineConfig.commit_ahead on, off or both; `--prefill-wait N` sets
EngineConfig.prefill_wait, and `--decode-buckets 1,2,4,8,16,32,64` pads the CPU's decode calls
to buckets as the CUDA path does (uncaptured), to profile that path's host work here;
`--switch-interval 5,0.5` runs each mode once per GIL switch interval (ms; Python's default is
5), each row labelled with it. A warm-up request runs first in each mode (CUDA graphs captured,
cuDNN plans built).

Per mode it prints the engine's step profile (StepProfile in serve/executor.py: schedule, kv,
inputs, run, readback, sample, emit, publish; ms per step, from perf_counter) and the wall time per
step of a clean pass, then, when torch with CUDA is importable (its profiler sees ORT's kernels
in the same process through CUPTI), runs the same requests again under the profiler for the
GPU's kernel time per step: what a step would cost if the host never made the GPU wait. CUPTI
slows the host's CUDA calls, so the wall time comes from the clean pass. `host share` = 1 - GPU
/ wall: the part of a step the host adds. `--cprofile N` prints the engine thread's N costliest
Python functions (cProfile over the profiled pass's steps).

With a CUDA build, `driver` gives the KV cache's CUDA driver calls of the clean pass
(cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, the cuCtxSynchronize before an
unmap): calls, µs a call and ms a step, what the `kv` phase is made of.

Steps are also split by kind (`by_kind`): `prefill`, a step that ran a prefill call (eager: ORT
launches every kernel), and `decode`, a step of decode rows alone (a CUDA graph's replay). The
decode steps' GPU time comes from a third pass whose profiler runs only while every request of
the burst is decoding; a prefill step's GPU time is the rest of the profiled pass's kernel time
over its prefill steps. With more requests than slots, the steps that decode alone come
between prefill steps, and the kinds get wall times and phases but no GPU split.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import itertools
import json
import pstats
import shlex
import sys
import threading
import time
import typing
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[2] / "bench"  # revision.py, step_table.py
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def gpu_profiler(ranges: bool = False):
    """torch.profiler over CUDA kernels (with `ranges`, the host's record_function ranges too:
    CallTimes' and StepRanges'), or None without torch/CUDA."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ranges else [])
    return profile(activities=activities)


def record_range(name: str):
    """A torch.profiler range on this thread (a no-op context without torch)."""
    try:
        from torch.profiler import record_function
    except ImportError:
        return contextlib.nullcontext()
    return record_function(name)


class CallTimes:
    """Wraps the executor's model calls: each call's host time by kind, from entering the
    executor's method to its tokens (ORT's Run returns when the call's kernels are done):
    `bucket` a padded decode call (a CUDA graph's replay where graphs are on), `graphed` a
    prefill step's call of fixed shapes (EngineConfig.graph_chunk; a graph too), `packed` a
    packed prefill call and `eager` a call of the model's rows as they are (both uncaptured:
    ORT launches each kernel). With `ranges`, each call is also a profiler range named
    RANGE + kind, whose kernels gpu_split() finds."""

    KINDS: typing.ClassVar[dict[str, str]] = {
        "run_staged": "bucket",
        "run_packed": "packed",
        "run_prepared": "packed",  # a packed call prepared during the last decode call
        "run_graphed": "graphed",
        "run": "eager",
    }
    RANGE = "kvl_call:"

    def __init__(self, executor, ranges: bool = False):
        self.executor, self.ranges = executor, ranges
        self.calls: collections.Counter = collections.Counter()
        self.ns: collections.Counter = collections.Counter()
        for method, kind in self.KINDS.items():
            setattr(executor, method, self._timed(getattr(executor, method), kind))

    def _timed(self, call, kind: str):
        def timed(*args, **kwargs):
            t = time.perf_counter_ns()
            try:
                if not self.ranges:
                    return call(*args, **kwargs)
                with record_range(self.RANGE + kind):
                    return call(*args, **kwargs)
            finally:
                self.ns[kind] += time.perf_counter_ns() - t
                self.calls[kind] += 1

        return timed

    def close(self) -> None:
        for method in self.KINDS:  # the class's methods again
            self.executor.__dict__.pop(method, None)

    def summary(self) -> dict:
        return {
            kind: {"calls": n, "wall_ms_per_call": self.ns[kind] / 1e6 / n}
            for kind, n in self.calls.items()
        }


def gpu_split(prof, prefix: str) -> dict[str, tuple[float, int]]:
    """Kernel time by the profiler range (named `prefix` + key) in which each kernel started:
    {key: (kernel ms, ranges)}; kernels outside every such range under "other". The ranges are
    the engine thread's and do not nest (one call, or one step, at a time), and a call's Run
    returns once its kernels are done, so a kernel starts inside the range that launched it."""
    import bisect

    ranges, kernels = [], []
    for event in prof.events():
        if event.name.startswith(prefix):
            ranges.append((event.time_range.start, event.time_range.end, event.name[len(prefix) :]))
        elif getattr(event.device_type, "name", "") == "CUDA":
            kernels.append((event.time_range.start, event.time_range.end))
    ranges.sort()
    starts = [r[0] for r in ranges]
    us: collections.Counter = collections.Counter()
    for start, end in kernels:
        i = bisect.bisect_right(starts, start) - 1
        key = ranges[i][2] if i >= 0 and start <= ranges[i][1] else "other"
        us[key] += end - start
    counts = collections.Counter(r[2] for r in ranges)
    return {key: (us[key] / 1000, counts.get(key, 0)) for key in {*us, *counts}}


def kernel_ms(prof) -> float:
    total_us = 0.0
    for event in prof.key_averages():
        total_us += getattr(event, "self_device_time_total", None) or getattr(
            event, "self_cuda_time_total", 0.0
        )
    return total_us / 1000


def top_kernels(prof, steps: int, n: int = 12) -> list[dict]:
    """The n kernels of most GPU time in a profiled pass: name (cut at 90 characters), us and
    launches per step; what a step's GPU time is made of (GEMMs, attention, gathers, sampling)."""
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(
            event, "self_cuda_time_total", 0.0
        )
        if us:
            rows.append((us, event.count, event.key))
    rows.sort(reverse=True)
    per = max(steps, 1)
    return [
        {"name": name[:90], "us_per_step": us / per, "launches_per_step": count / per}
        for us, count, name in rows[:n]
    ]


def burst(engine, prompts, params, submitted=None) -> float:
    """Submits every prompt at once (params: one RequestParams a prompt); seconds until the last
    one finished. `submitted` (optional) is called once every prompt was submitted."""
    left = threading.Semaphore(0)
    start = time.perf_counter()
    # The whole burst reaches the engine's inbox at once (its loop takes the inbox under this
    # re-entrant lock): the first step admits every request that fits, however fast this host
    # submits, so that two runs' steps compare.
    with engine._cond:
        for p, param in zip(prompts, params, strict=True):
            engine.submit(p, param, on_event=lambda e: e.finished and left.release())
    if submitted is not None:
        submitted()
    for _ in prompts:
        left.acquire()
    return time.perf_counter() - start


class EmulatedDevice:
    """The session with a device behind it (--device-ms): each run_with_iobinding also sleeps
    `ms`, with the GIL released as ORT's Run releases it while a GPU works, and the calls' whole
    time counts as busy. On the CPU it separates the host's critical path (the time between
    Runs, when the device would wait) from the device's time, whatever the host's speed."""

    def __init__(self, session, ms: float):
        self._session, self._s = session, ms / 1000.0
        self.busy_ns = 0

    def __getattr__(self, name):
        return getattr(self._session, name)

    def run_with_iobinding(self, *args, **kwargs):
        t = time.perf_counter_ns()
        try:
            return self._session.run_with_iobinding(*args, **kwargs)
        finally:
            time.sleep(self._s)
            self.busy_ns += time.perf_counter_ns() - t


class StepKinds:
    """Wraps engine._step: each step's wall time and phases (the engine's StepProfile), summed
    by kind: "prefill" when the step ran a prefill call, else "decode". With `profiler`, starts
    it at the first step where every request is decoding (none waiting or prefilling) and stops
    it after the step that ends the last request, both on the engine thread that launches the
    kernels."""

    KINDS = ("decode", "prefill")

    def __init__(self, engine, profiler=None):
        self.engine, self.profiler = engine, profiler
        self.step = engine._step
        self.steps = dict.fromkeys(self.KINDS, 0)
        self.wall_ns = dict.fromkeys(self.KINDS, 0)
        self.phase_ns = {k: collections.Counter() for k in self.KINDS}
        self.armed = False  # set once every request of the burst was submitted
        self.profiling = False
        self.profiled_steps = 0

    def _all_decoding(self) -> bool:
        e = self.engine
        slots = [r for r in e._slots if r is not None]
        return bool(slots) and not e._waiting and not e._inbox and all(r.decoding for r in slots)

    def __call__(self) -> None:
        e = self.engine
        start = self.profiler is not None and self.armed and not self.profiling
        if start and self._all_decoding():
            self.profiler.start()
            self.profiling = True
        calls, steps = e._counters["prefill_calls"], e._counters["steps"]
        phases = dict(e.executor.profile.ns)
        t = time.perf_counter_ns()
        try:
            self.step()
        finally:
            wall = time.perf_counter_ns() - t
            kind = "prefill" if e._counters["prefill_calls"] > calls else "decode"
            # one call of _step runs one step, or (EngineConfig.pipeline) a run of decode steps
            n = max(e._counters["steps"] - steps, 1)
            self.steps[kind] += n
            self.wall_ns[kind] += wall
            now = e.executor.profile.ns
            self.phase_ns[kind].update({p: now[p] - phases.get(p, 0) for p in now})
            if self.profiling:
                self.profiled_steps += n
                if not any(r is not None for r in e._slots) and not e._waiting:
                    self.profiler.stop()
                    self.profiler = None  # once

    def summary(self) -> dict:
        out = {}
        for kind in self.KINDS:
            n = self.steps[kind]
            if n:
                out[kind] = {
                    "steps": n,
                    "wall_ms_per_step": self.wall_ns[kind] / 1e6 / n,
                    "phase_ms_per_step": {p: v / 1e6 / n for p, v in self.phase_ns[kind].items()},
                }
        return out


def wrapped_burst(engine, prompts, params, kinds: StepKinds) -> float:
    """burst() with engine._step wrapped by `kinds`."""
    engine._step = kinds
    try:
        # armed once every request was submitted: a step before that may see the first
        # requests decode while later ones are yet to come
        return burst(engine, prompts, params, submitted=lambda: setattr(kinds, "armed", True))
    finally:
        engine._step = kinds.step


def decode_gpu(engine, prompts, params, args) -> tuple[float, int, list[dict]] | None:
    """GPU ms per decode-only step (a pass whose profiler covers only the steps where every
    request decodes), how many such steps it saw and their top kernels; None without
    torch/CUDA."""
    prof = gpu_profiler() if args.provider == "cuda" else None
    if prof is None:
        return None
    kinds = StepKinds(engine, prof)
    wrapped_burst(engine, prompts, params, kinds)
    if not kinds.profiled_steps:
        return None
    if kinds.profiler is not None:  # the last step did not end the burst's last request
        prof.stop()
    steps = kinds.profiled_steps
    return kernel_ms(prof) / steps, steps, top_kernels(prof, steps)


class StepRanges:
    """Wraps engine._step in a profiler range a call (named RANGE + its index), noting each
    one's kind as StepKinds does, so that gpu_split() gives the kernel time of each kind. With
    `profiler`, starts it in the first step and stops it after the step that leaves the engine
    idle, both on the engine thread: torch's profiler records the ranges of the thread that
    started it (CUPTI sees every thread's kernels)."""

    RANGE = "kvl_step:"

    def __init__(self, engine, profiler=None):
        self.engine, self.step, self.profiler = engine, engine._step, profiler
        self.kinds: list[str] = []
        self.steps: collections.Counter = collections.Counter()
        self.stopped = threading.Event()
        self.armed = False  # set once every request of the burst was submitted
        if profiler is None:
            self.stopped.set()

    def __call__(self) -> None:
        e = self.engine
        if self.profiler is not None and not self.kinds:
            self.profiler.start()
        calls, steps = e._counters["prefill_calls"], e._counters["steps"]
        try:
            with record_range(f"{self.RANGE}{len(self.kinds)}"):
                self.step()
        finally:
            kind = "prefill" if e._counters["prefill_calls"] > calls else "decode"
            self.kinds.append(kind)
            self.steps[kind] += max(e._counters["steps"] - steps, 1)
            idle = not any(r is not None for r in e._slots) and not e._waiting
            if self.profiler is not None and self.armed and idle and not self.stopped.is_set():
                self.profiler.stop()
                self.stopped.set()

    def gpu_ms_per_step(self, prof) -> dict[str, float]:
        """Kernel ms per step of each kind."""
        ms: collections.Counter = collections.Counter()
        for key, (kernel_ms, _) in gpu_split(prof, self.RANGE).items():
            if key != "other":
                ms[self.kinds[int(key)]] += kernel_ms
        return {kind: ms[kind] / n for kind, n in self.steps.items()}


def profiled_burst(engine, prompts, params, args) -> dict:
    """The burst again under CUPTI and, with --cprofile, cProfile on the engine thread's steps:
    {"gpu": GPU ms per step (None without CUPTI), "cprofile": cProfile's table (or None),
    "kernels": the top kernels per step, "by_kind": GPU ms per step of each step kind, "calls":
    each call kind's GPU ms per call and the calls seen}."""
    prof = gpu_profiler(ranges=True) if args.provider == "cuda" else None
    cprof = cProfile.Profile() if args.cprofile else None
    out = {"gpu": None, "cprofile": None, "kernels": [], "by_kind": {}, "calls": {}}
    if prof is None and cprof is None:
        return out
    step = engine._step
    ranges = StepRanges(engine, prof) if prof is not None else None
    timed = ranges if ranges is not None else step

    def profiled_step():
        cprof.enable()
        try:
            timed()
        finally:
            cprof.disable()

    engine._step = profiled_step if cprof is not None else timed
    calls = CallTimes(engine.executor, ranges=True) if prof is not None else None
    steps = engine.stats()["steps"]
    try:
        armed = (lambda: setattr(ranges, "armed", True)) if ranges is not None else None
        burst(engine, prompts, params, submitted=armed)
        # the step that finished the last request returns after its events were delivered
        if ranges is not None and not ranges.stopped.wait(30):
            raise RuntimeError("step_profile: the engine did not go idle after the burst")
    finally:
        engine._step = step
        if calls is not None:
            calls.close()
    steps = max(engine.stats()["steps"] - steps, 1)
    if cprof is not None:
        text = io.StringIO()
        pstats.Stats(cprof, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        out["cprofile"] = text.getvalue()
    if prof is None:
        return out
    out["gpu"] = kernel_ms(prof) / steps
    out["kernels"] = top_kernels(prof, steps)
    out["by_kind"] = ranges.gpu_ms_per_step(prof)
    out["calls"] = {
        kind: {"calls": n, "gpu_ms_per_call": ms / max(n, 1)}
        for kind, (ms, n) in gpu_split(prof, CallTimes.RANGE).items()
        if kind != "other"
    }
    return out


# --modes: the graph a step runs, as EngineConfig arguments
MODES = {
    "device": {"sample_on_device": True, "packed": False},  # served, a call per prefill chunk
    "packed": {"sample_on_device": True, "packed": True},  # a step's chunks in one call
    "mixed": {"sample_on_device": True, "packed": True, "mixed": True},  # decode rows too
    "host": {"sample_on_device": False},  # the model's own graph, sampled on the host
}


def driver_delta(before: dict, after: dict) -> dict:
    """The driver calls made between two kv_memory.driver_times() readings (those called)."""
    out = {}
    for name, t in after.items():
        was = before.get(name, {"calls": 0, "ns": 0})
        calls = t["calls"] - was["calls"]
        if calls:
            out[name] = {"calls": calls, "ns": t["ns"] - was["ns"]}
    return out


def parse_buckets(text: str) -> tuple[int, ...]:
    from ort_kvlayout.serve.arguments import parse_buckets as parse  # the serve CLI's rule

    return parse(text)


def length_range(text: str) -> tuple[int, int]:
    """--prompt / --output: "N", or "A:B" for lengths uniform in [A, B]."""
    lo, _, hi = text.partition(":")
    bounds = (int(lo), int(hi or lo))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or A:B with 1 <= A <= B")
    return bounds


def draw(rng, bounds: tuple[int, int], n: int) -> list[int]:
    """n lengths uniform in [lo, hi] (all lo when lo == hi)."""
    return rng.integers(bounds[0], bounds[1] + 1, n).tolist()


def run_mode(
    args, mode: str, overlap: bool | None, ahead: bool = False, pipeline: bool = False,
    graph_chunk: int = 0, device_ids: bool = False,
) -> dict:  # fmt: skip
    from ort_kvlayout.runtime.kv_memory import driver_times
    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    config = EngineConfig(
        max_batch=args.max_batch or args.batch, provider=args.provider,
        prefill_chunk=args.prefill_chunk, capacity=args.capacity, kv_budget_bytes=args.kv_budget,
        max_waiting=max(args.requests or 0, args.batch) + 1, cuda_graph=False if args.no_cuda_graph else None,
        overlap=overlap, commit_ahead=ahead, prefill_wait=args.prefill_wait, pipeline=pipeline,
        decode_buckets=args.decode_buckets, graph_chunk=graph_chunk, device_ids=device_ids,
        **MODES[mode],
    )  # fmt: skip
    rng = np.random.default_rng(args.seed)
    options = None
    if args.threads:  # ORT's intra-op threads (the rest of the cores: the engine's threads)
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
    with Engine(args.model, config, session_options=options) as engine:
        device = None
        if args.device_ms:  # every Run also holds the device this long (GIL released)
            device = engine.runtime.session = EmulatedDevice(engine.runtime.session, args.device_ms)
        vocab = engine.spec.vocab_size
        engine.generate(
            rng.integers(16, vocab, 8).tolist(), RequestParams(max_tokens=4, ignore_eos=True)
        )
        before = engine.stats()
        requests = args.requests or args.batch
        lengths = draw(rng, args.prompt, requests)
        prompts = [rng.integers(16, vocab, n).tolist() for n in lengths]
        params = [
            RequestParams(max_tokens=n, ignore_eos=True) for n in draw(rng, args.output, requests)
        ]
        kinds = StepKinds(engine)
        driver_before = driver_times()
        busy_before = device.busy_ns if device is not None else 0
        calls = CallTimes(engine.executor)
        try:
            wall = wrapped_burst(engine, prompts, params, kinds)
        finally:
            calls.close()
        busy = (device.busy_ns - busy_before) / 1e6 if device is not None else None
        after = engine.stats()
        driver = driver_delta(driver_before, driver_times())
        profiled = profiled_burst(engine, prompts, params, args)
        gpu, cprofile_table, kernels = profiled["gpu"], profiled["cprofile"], profiled["kernels"]
        # with more requests than slots, steps that decode alone come between prefill steps:
        # the decode-only pass (which profiles from the first all-decoding step on) would time
        # only the tail, so the kinds get no GPU split then
        decode = decode_gpu(engine, prompts, params, args) if requests <= config.max_batch else None
    steps = after["steps"] - before["steps"]
    phases = {
        p: after["step_profile"]["total_ms"][p] - before["step_profile"]["total_ms"][p]
        for p in after["step_profile"]["total_ms"]
    }
    out = {
        "mode": mode,
        "overlap": config.overlapped,
        "commit_ahead": ahead,
        "pipeline": pipeline,
        "prefill_wait": args.prefill_wait,
        "ort_threads": args.threads or None,
        "sample_on_device": after["sample_on_device"],
        "steps": steps,
        "wall_s": wall,
        "wall_ms_per_step": wall * 1000 / max(steps, 1),
        "phase_ms_per_step": {p: v / max(steps, 1) for p, v in phases.items()},
        "requests": requests,
        "output_tok_s": sum(p.max_tokens for p in params) / wall,
        "decode_calls": after["decode_calls"] - before["decode_calls"],
        "prefill_calls": after["prefill_calls"] - before["prefill_calls"],
        "packed": after.get("packed", False),
        "graph_replays": after["graph_replays"] - before["graph_replays"],
    }
    if driver:
        out["driver"] = {
            name: {**t, "us_per_call": t["ns"] / 1e3 / t["calls"], "ms_per_step": t["ns"] / 1e6 / max(steps, 1)}
            for name, t in driver.items()
        }  # fmt: skip
    if busy is not None:  # the emulated device's busy time: what a GPU's time would be
        out["device_ms"] = args.device_ms
        out["run_busy_ms_per_step"] = busy / max(steps, 1)
        out["host_share"] = 1 - out["run_busy_ms_per_step"] / out["wall_ms_per_step"]
    if gpu is not None:
        out["gpu_ms_per_step"] = gpu
        out["host_share"] = 1 - gpu / out["wall_ms_per_step"]
        out["gpu_kernels"] = kernels
    out["by_kind"] = by_kind = kinds.summary()
    # each kind's GPU time: the kernels each step of the profiled pass launched
    for kind, row in by_kind.items():
        if kind in profiled["by_kind"]:
            row["gpu_ms_per_step"] = profiled["by_kind"][kind]
            row["host_share"] = 1 - row["gpu_ms_per_step"] / row["wall_ms_per_step"]
    if decode is not None and "decode" in by_kind:  # the decode-only pass's own kernels
        row = by_kind["decode"]
        row["decode_only_gpu_ms_per_step"], row["gpu_steps"], row["gpu_kernels"] = decode
    # each call kind's host time (this pass) against its GPU time (the profiled pass)
    out["calls"] = by_call = calls.summary()
    for kind, row in by_call.items():
        gpu_row = profiled["calls"].get(kind)
        if gpu_row is not None:
            row["gpu_ms_per_call"] = gpu_row["gpu_ms_per_call"]
            row["host_ms_per_call"] = row["wall_ms_per_call"] - row["gpu_ms_per_call"]
    if cprofile_table is not None:
        out["cprofile"] = cprofile_table
    return out


def table(results: list[dict]) -> str:
    from step_table import cells, rows_by_kind  # bench/step_table.py

    phases = list(results[0]["phase_ms_per_step"])
    head = ["mode", "overlap", "commit ahead", "pipeline", "prefill wait", "steps",
            "wall ms/step", *phases,
            "GPU ms/step", "host share", "tok/s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        settings = ["on" if r.get("overlap") else "off", "on" if r.get("commit_ahead") else "off",
                    "on" if r.get("pipeline") else "off", str(r.get("prefill_wait", 0))]  # fmt: skip
        name = r["mode"] + (f" ({r['label']})" if r.get("label") else "")
        for label, row in rows_by_kind(r, name):
            lines.append("| " + " | ".join([label, *settings, *cells(r, row, phases)]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, default=8, help="requests, all at once")
    p.add_argument("--max-batch", type=int, help="engine slots (default: --batch)")
    p.add_argument(
        "--requests", type=int, help="requests of the burst (default: --batch); more than the "
        "slots: requests wait and slots turn over, as in a serving burst"
    )  # fmt: skip
    p.add_argument("--prompt", type=length_range, default="128", help="N or A:B (uniform)")
    p.add_argument("--output", type=length_range, default="64", help="N or A:B (uniform)")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens a step (default: the engine's)")
    p.add_argument("--capacity", type=int)
    p.add_argument("--kv-budget", type=int)
    p.add_argument("--modes", default="device,host", help=f"of {', '.join(MODES)}")
    p.add_argument(
        "--overlap", default="", help="on,off: each mode both ways (default: the engine's choice)"
    )
    p.add_argument(
        "--commit-ahead", default="off",
        help="on, off or on,off: EngineConfig.commit_ahead (the next step's KV rows committed "
        "during a step's calls)",
    )  # fmt: skip
    p.add_argument(
        "--pipeline", default="off",
        help="on, off or on,off: EngineConfig.pipeline (decode steps launched back to back, "
        "the next one planned during a step's Run)",
    )  # fmt: skip
    p.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="print the engine thread's N costliest functions (cProfile)",
    )
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument(
        "--decode-buckets", type=parse_buckets, metavar="SIZES",
        help="EngineConfig.decode_buckets, e.g. 1,2,4,8,16,32,64: on the CPU the padded decode "
        "calls of the CUDA path, uncaptured (default: the engine's)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-wait", type=int, default=0, metavar="STEPS",
        help="EngineConfig.prefill_wait: steps a waiting prompt may be held for company",
    )  # fmt: skip
    p.add_argument(
        "--device-ms", type=float, default=0.0, metavar="MS",
        help="each Run also holds an emulated device MS ms (a sleep, GIL released): on the "
        "CPU, the host share of a step with a device of that speed",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=0, metavar="N",
        help="ORT's intra-op threads (default: ORT's, every core): fewer leave cores to the "
        "engine's own threads, as a GPU's host has",
    )  # fmt: skip
    p.add_argument(
        "--switch-interval", default="", metavar="MS[,MS]",
        help="the interpreter's GIL switch interval (sys.setswitchinterval) for each pass, in "
        "ms (default: Python's, 5 ms): how long a thread returning from Run may wait for the "
        "GIL while another thread runs Python",
    )  # fmt: skip
    p.add_argument(
        "--graph-chunk", default="0", metavar="N[,N]",
        help="EngineConfig.graph_chunk for each pass: a step that prefills runs as one call of "
        "fixed shapes (a CUDA graph each), each prompt's chunk at most N tokens (0: eager "
        "packed prefill calls, the default); e.g. 0,64 compares both",
    )  # fmt: skip
    p.add_argument(
        "--device-ids", default="off",
        help="on, off or on,off: EngineConfig.device_ids (pipelined decode calls fed their ids "
        "from the last call's tokens on the device)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    try:
        switches = (
            [float(s) for s in args.switch_interval.split(",")] if args.switch_interval else [None]
        )
    except ValueError:
        p.error(f"--switch-interval {args.switch_interval!r}: expected ms values, e.g. 5,0.5")
    if any(s is not None and s <= 0 for s in switches):
        p.error(f"--switch-interval {args.switch_interval!r}: each value must be > 0 ms")
    overlaps = {"": None, "on": True, "off": False}
    settings = [s.strip() for s in args.overlap.split(",")] if args.overlap else [""]
    if any(s not in overlaps for s in settings):
        p.error(f"--overlap {args.overlap!r}: expected on, off or on,off")
    aheads = on_off(p, "--commit-ahead", args.commit_ahead)
    pipes = on_off(p, "--pipeline", args.pipeline)
    try:
        graph_chunks = [int(c) for c in args.graph_chunk.split(",")]
    except ValueError:
        p.error(f"--graph-chunk {args.graph_chunk!r}: expected token counts, e.g. 0,64")
    if any(c < 0 for c in graph_chunks):
        p.error(f"--graph-chunk {args.graph_chunk!r}: each value must be >= 0 (0: eager prefill)")
    feeds = on_off(p, "--device-ids", args.device_ids)
    results = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            p.error(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        passes = itertools.product(settings, aheads, pipes, switches, graph_chunks, feeds)
        for setting, ahead, pipe, switch, graph_chunk, fed in passes:
            default = sys.getswitchinterval()
            if switch is not None:
                sys.setswitchinterval(switch / 1000)
            try:
                results.append(
                    run_mode(
                        args,
                        mode,
                        overlaps[setting],
                        ahead,
                        pipe,
                        graph_chunk,
                        fed,
                    )
                )
            finally:
                sys.setswitchinterval(default)
            labels = []
            if switch is not None:
                results[-1]["switch_interval_ms"] = switch
                labels.append(f"GIL switch interval {switch:g} ms")
            if len(graph_chunks) > 1 or graph_chunk:
                results[-1]["graph_chunk"] = graph_chunk
                labels.append(f"graph chunk {graph_chunk}" if graph_chunk else "eager prefill")
            if len(feeds) > 1 or fed:
                results[-1]["device_ids"] = fed
                labels.append("ids on the device" if fed else "ids from the host")
            if labels:
                results[-1]["label"] = ", ".join(labels)
            table_text = results[-1].pop("cprofile", None)
            print(json.dumps(results[-1]), file=sys.stderr)
            if table_text:
                print(table_text, file=sys.stderr)
                results[-1]["cprofile"] = table_text
    print(table(results))
    for r in results:
        from step_table import call_lines  # bench/step_table.py

        lines = call_lines(r, r["mode"] + (f" ({r['label']})" if r.get("label") else ""))
        if lines:
            print("\n" + "\n".join(lines))
    kernel_lines = kernel_table(results)
    if kernel_lines:
        print("\n".join(kernel_lines))
    if args.json:
        args.json.write_text(json.dumps(record(args, argv, results), indent=1) + "\n")
    return 0


def on_off(p: argparse.ArgumentParser, flag: str, text: str) -> list[bool]:
    """A flag's "on", "off" or "on,off": each pass's setting, in order."""
    settings = [s.strip() for s in text.split(",")]
    if any(s not in ("on", "off") for s in settings):
        p.error(f"{flag} {text!r}: expected on, off or on,off")
    return [s == "on" for s in settings]


def kernel_table(results: list[dict]) -> list[str]:
    """The top kernels of each profiled pass (all steps, and decode-only steps where measured):
    us and launches per step."""
    lines = []
    for r in results:
        passes = [("all steps", r.get("gpu_kernels"))]
        passes.append(
            ("decode-only steps", r.get("by_kind", {}).get("decode", {}).get("gpu_kernels"))
        )
        for label, kernels in passes:
            if not kernels:
                continue
            overlap = {True: "on", False: "off"}.get(r.get("overlap"), "-")
            lines += ["", f"GPU kernels per step, {r['mode']} (overlap {overlap}), {label}:", "",
                      "| kernel | us/step | launches/step |", "|---|---:|---:|"]  # fmt: skip
            lines += [
                f"| {k['name']} | {k['us_per_step']:.1f} | {k['launches_per_step']:.1f} |"
                for k in kernels
            ]
    return lines


def record(args, argv: list[str] | None, results: list[dict]) -> dict:
    """The JSON bench/report.py renders: when, where, which commit and command, the results."""
    from revision import device_name, git_revision  # bench/revision.py

    words = argv if argv is not None else sys.argv[1:]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device_name(args.provider),
        "commit": git_revision(mark_dirty=False),
        "command": "python tools/perf/step_profile.py " + shlex.join(words),
        "results": results,
    }


if __name__ == "__main__":
    sys.exit(main())
