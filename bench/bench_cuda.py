"""CUDA benchmark: ai.kvlayout::GroupQueryAttention (kv_layout 0 and 1) vs ORT's built-in
com.microsoft::GroupQueryAttention on the CUDA EP, fp16, in one process.

Each case builds three single-node models on the same logical inputs and runs them through IO
binding with every tensor on the GPU. Decode binds one buffer as past and present (the shared,
in-place cache onnxruntime-genai uses; capacity = L). Kernel time is measured with CUPTI through
torch.profiler (the sum of the device kernels of one Run; ORT's per-Run host overhead of
~100 us is excluded).

Metrics: decode TB/s of KV read = 2 * B * Nkv * L * H * 2 bytes / kernel time;
prefill TFLOP/s with causal flops = 4 * B * N * H * S*(S+1)/2. Kernel time is the median over
the timed Runs of the summed device time of one Run's kernels.

Each variant's timed Runs follow one another on one cache (warm: the L2 holds what the last Run
left); --flush-l2 empties the L2 before each timed Run instead, as a model's weight MatMuls do
between two attention layers.

Inputs are drawn on the GPU (torch) and bound by pointer, so the largest cases (B=64, L=32k:
8.6 GB of KV per variant) cost no host time.

  python bench/bench_cuda.py                 # the issue-8 grid: 4 head shapes, decode B x L, prefill B x S
  python bench/bench_cuda.py --heads 32/8/128 --decode 64x16384 --prefill ""
  python bench/bench_cuda.py --json bench/results/cuda-h200.json
  python bench/bench_cuda.py --rotary --heads 28/4/128 --decode 1x4096 --prefill ""  # as LLMs run it
  python bench/bench_cuda.py --flush-l2 --heads 28/4/128 --decode 1x4096 --prefill ""  # cold L2
  python bench/bench_cuda.py --kv-quant int8-per-tensor,int8-per-channel,int4-per-channel \
      --heads 32/8/128,28/4/128 --decode 1x16384,8x16384,1x32768 --prefill ""  # quantized caches
  python bench/bench_cuda.py --kv-quant int8-per-token,fp8-per-token,fp8-per-tensor \
      --heads 32/8/128 --decode 1x16384,8x16384 --prefill ""  # ours: per-token scales, fp8

--kv-quant SCHEMES: quantized decode (ORT's contract: int8 / packed int4 caches, per-tensor or
per-channel float32 scales) for each decode case and scheme: ours with the quantized cache in
both layouts (q0, q1), our fp16 path (kv0, kv1) and ORT's built-in GQA with the same quantized
cache (ort_q; per-tensor int8 gives its k_scale and v_scale one tensor, the form its XQA decode
kernel takes) and with fp16 (ort), all in one run on the same logical inputs. Ratios in the
JSON: q_vs_fp16 (our quantized time / our fp16 time, per layout; the issue's target <= 0.55 at
L >= 16k for int8) and q_speedup_vs_ort_q (ORT's quantized time / ours; target >= 1.5). TB/s
counts the bytes the cache holds (codes: half of fp16's for int8, a quarter for int4).
Also fp8 (float8e4m3fn caches, static scales: ORT CUDA 1.31.1 may refuse them, recorded as
refused) and our PER_TOKEN schemes (int8 / int4 / fp8 -per-token: a float32 scale cache beside
each KV cache, bound shared like the cache; ORT has no such mode, so ort_q is recorded as
refused and the ratio that counts is q_vs_fp16).

--quant-plan bytes|fp16 sets ORT_KVLAYOUT_DECODE_QUANT_PLAN for the run (our quantized decode's
own plan, or the plan of a cache of T; read once per process, so one run per value, e.g.
`--quant-plan fp16 --json a.json` then `--quant-plan bytes --json b.json`); the JSON records it
and every ORT_KVLAYOUT_* variable of the run under "knobs".
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import ort_kvlayout
from onnx import TensorProto, helper
from ort_kvlayout.op.layout import kv_strides
from revision import git_revision  # a sibling: bench/revision.py

INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length")
OUTPUTS = ("output", "present_key", "present_value")
ROTARY_INPUTS = ("cos_cache", "sin_cache")
# PER_TOKEN (ai.kvlayout): the scale caches, inputs 17 and 18, outputs 4 and 5 (shared in place).
SCALE_CACHES = ("past_key_scale", "past_value_scale", "present_key_scale", "present_value_scale")
CACHE_TYPES = {"int8": TensorProto.INT8, "int4": TensorProto.UINT8,
               "fp8": TensorProto.FLOAT8E4M3FN}  # fmt: skip


def build_model(
    domain: str,
    n: int,
    nkv: int,
    layout: int | None,
    rotary: bool = False,
    quant: tuple[int, str, str] | None = None,
) -> bytes:
    """One GroupQueryAttention node; with `rotary`, do_rotary=1 and fp16 cos/sin caches as
    inputs 7 and 8 (the op rotates q and the new k itself, as in exported LLMs). `quant`: (bits,
    PER_TENSOR | PER_CHANNEL | PER_TOKEN, int8 | int4 | fp8): an int8, packed int4 uint8 or
    float8e4m3fn cache and float32 scales as inputs 12 and 13 (per-tensor: one input "kv_scale"
    for both, ORT's XQA form), or (PER_TOKEN, ai.kvlayout only) the scale caches as inputs 17 and
    18 and outputs 4 and 5."""
    f16 = TensorProto.FLOAT16
    cache = f16 if quant is None else CACHE_TYPES[quant[2]]
    ins = [helper.make_tensor_value_info(name, f16, None) for name in INPUTS[:3]]
    ins += [helper.make_tensor_value_info(name, cache, None) for name in INPUTS[3:5]]
    ins += [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    names = list(INPUTS)
    attrs = {"num_heads": n, "kv_num_heads": nkv}
    if rotary:
        ins += [helper.make_tensor_value_info(name, f16, None) for name in ROTARY_INPUTS]
        names += list(ROTARY_INPUTS)
        attrs["do_rotary"] = 1
    outputs = list(OUTPUTS)
    if quant is not None and quant[1] == "PER_TOKEN":
        names += [""] * (17 - len(names)) + list(SCALE_CACHES[:2])
        ins += [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
                for name in SCALE_CACHES[:2]]  # fmt: skip
        outputs += ["", *SCALE_CACHES[2:]]
        attrs.update(k_quant_type=quant[1], v_quant_type=quant[1], kv_cache_bit_width=quant[0])
    elif quant is not None:
        scales = ["kv_scale", "kv_scale"] if quant[1] == "PER_TENSOR" else ["k_scale", "v_scale"]
        names += [""] * (12 - len(names)) + scales
        ins += [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
                for name in dict.fromkeys(scales)]  # fmt: skip
        attrs.update(k_quant_type=quant[1], v_quant_type=quant[1], kv_cache_bit_width=quant[0])
    if layout is not None:
        attrs["kv_layout"] = layout
    node = helper.make_node("GroupQueryAttention", names, outputs, domain=domain,
                            **attrs)  # fmt: skip
    outs = [helper.make_tensor_value_info("output", f16, None)]
    outs += [helper.make_tensor_value_info(name, cache, None) for name in OUTPUTS[1:]]
    outs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
             for name in outputs[len(OUTPUTS) + 1:]]  # fmt: skip
    graph = helper.make_graph([node], "gqa", ins, outs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)]
    )
    model.ir_version = 10
    return model.SerializeToString()


LIBRARY: str | None = None  # --library: a libort_kvlayout.so to load instead of the package's
BREAKDOWN = False  # --breakdown: per-kernel device times on stderr and in the JSON
# --span: a Run's time from its first kernel's start to its last kernel's end, instead of the
# sum of its kernels' times: the gaps between an op's kernels count (without a CUDA graph they
# include the host's launches), and kernels that overlap are not counted twice.
SPAN = False
# --capacity C: decode caches of C rows (at least L) for L live keys, as a runtime that reserves
# the whole context binds them (onnxruntime-genai, ort_kvlayout.runtime.generation); 0: C = L.
CAPACITY = 0
# --rotary: the op rotates q and the new k (do_rotary=1, cos/sin caches), as exported LLMs run it.
ROTARY = False
# --rounds R: the three variants' timed Runs interleaved in R rounds (run_case).
ROUNDS = 1
# --order: the variants in the order their sessions and caches are made (so where their caches
# lie in device memory) and their turns taken. At 4/1/256 (one KV head) the two layouts are the
# same bytes at the same offsets, yet kv_layout=1 measured 7% slower than kv_layout=0 at B=8
# L=16k in the grid (twenty-fourth session): a place or an order, never a layout.
VARIANTS = ("ort", "kv0", "kv1")
ORDER = VARIANTS


def parse_order(text: str) -> tuple[str, ...]:
    order = tuple(x.strip() for x in text.split(","))
    if sorted(order) != sorted(VARIANTS):
        raise ValueError(
            f"--order: the three variants {', '.join(VARIANTS)} once each, got {text!r}"
        )
    return order


def kv_read_bytes(b: int, nkv: int, length: int, h: int) -> int:
    """Bytes of K and V a decode call reads: 2 x B x Nkv x L x H x 2 (fp16), the TB/s numerator."""
    return 2 * b * nkv * length * h * 2


def turns(order: tuple[str, ...], runs: int, rounds: int) -> list[tuple[str, int]]:
    """The timed turns of --rounds R: (variant, Runs) per turn, R rounds of the variants in
    `order`, the order reversed every other round, the Runs split as evenly as they go (R at
    least 1 and at most the Runs). bench_stack.py's --rounds takes its steps in the same turns."""
    rounds = max(1, min(rounds, runs))
    out = []
    for r in range(rounds):
        n = runs // rounds + (1 if r < runs % rounds else 0)
        out += [(v, n) for v in (order if r % 2 == 0 else order[::-1])]
    return out


# --flush-l2: every timed Run starts with nothing of its inputs in the L2 (a read of a buffer
# twice the L2's size before it), as in a model whose layers' caches together exceed the L2.
# Without it, back-to-back Runs on one cache find in the L2 what the last Run left there.
FLUSH_L2 = False
FLUSH_EVENTS: list[str] = []  # the device events of one flush, by name, sorted
_FLUSH_BUF = None


def flush_l2() -> None:
    """Reads a buffer of twice the L2's size (a read: no dirty lines to write back later), then
    waits for it: the flush runs on torch's stream, the op on ORT's, and nothing else orders
    them."""
    import torch

    global _FLUSH_BUF
    if _FLUSH_BUF is None:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        _FLUSH_BUF = torch.ones(2 * l2 // 4, dtype=torch.float32, device="cuda")
    _FLUSH_BUF.sum()
    torch.cuda.synchronize()


def device_events(prof) -> list:
    """The profile's device events (kernels, memsets, copies) with a duration, by start time."""
    return sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0),
        key=lambda e: e.time_range.start,
    )


def events_of(action) -> list[str]:
    """The device events one call of `action` runs (profiled once, alone, after an untimed call),
    by name, sorted."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    action()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        action()
        torch.cuda.synchronize()
    return sorted(e.name for e in device_events(prof))


def flush_events() -> list[str]:
    """The device events one flush_l2() runs: its reduction kernel and, with torch's multi-block
    reductions, a memset of their semaphores."""
    return events_of(flush_l2)


def split_rounds(events: list, runs: int, pre: list[str]) -> list[list]:
    """`events` (by start time) cut into `runs` rounds of the same count, each round's first
    len(pre) events dropped after checking they are `pre` by name. Not by name alone: a
    flush's memset and an op's memset have the same name."""
    k, per = len(pre), len(events) // runs
    if per * runs != len(events):
        raise RuntimeError(f"{len(events)} device events over {runs} rounds: not a fixed set each")
    shares = [events[i * per : (i + 1) * per] for i in range(runs)]
    for i, share in enumerate(shares):
        if sorted(e.name for e in share[:k]) != pre:
            raise RuntimeError(f"round {i} does not start with the events {pre}")
    return [share[k:] for share in shares]


def session(model: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    if LIBRARY:
        so.register_custom_ops_library(LIBRARY)
    else:
        ort_kvlayout.register(so)
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CUDAExecutionProvider"])


def bind(sess, feeds: dict, shared: bool, types: dict | None = None):
    """Binds torch CUDA tensors (and the CPU scalar total_sequence_length) by pointer. `types`:
    ONNX element types by name, where the tensor's bytes are another type's (an fp8 cache held
    in uint8). PER_TOKEN scale caches (past_*_scale in feeds) are bound shared as their
    presents, like the caches."""
    import torch

    io = sess.io_binding()
    keep = dict(feeds)
    elem = {torch.float16: np.float16, torch.int32: np.int32, torch.int8: np.int8,
            torch.uint8: np.uint8, torch.float32: np.float32}  # fmt: skip
    for name, t in feeds.items():
        if name == "total_sequence_length":
            keep[name] = ort.OrtValue.ortvalue_from_numpy(t, "cpu", 0)
            io.bind_ortvalue_input(name, keep[name])
            continue
        etype = (types or {}).get(name, elem[t.dtype])
        io.bind_input(name, "cuda", 0, etype, list(t.shape), t.data_ptr())
    b, s, d = feeds["query"].shape
    keep["output"] = out = torch.empty((b, s, d), dtype=torch.float16, device="cuda")
    io.bind_output("output", "cuda", 0, np.float16, [b, s, d], out.data_ptr())
    pairs = [("past_key", "present_key"), ("past_value", "present_value")]
    if SCALE_CACHES[0] in feeds:
        pairs += [(SCALE_CACHES[0], SCALE_CACHES[2]), (SCALE_CACHES[1], SCALE_CACHES[3])]
    for past, present in pairs:
        if shared:
            t = feeds[past]
            etype = (types or {}).get(past, elem[t.dtype])
            io.bind_output(present, "cuda", 0, etype, list(t.shape), t.data_ptr())
        else:
            io.bind_output(present, "cuda", 0)
    return io, keep


def kernel_times(sess, io, runs: int) -> tuple[list[float], dict[str, float]]:
    """Device time of each Run (ms: its kernels summed, from CUPTI), and per kernel (us/Run).
    With --flush-l2, each Run follows a read of a buffer twice the L2's size, whose kernels are
    not counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            if FLUSH_L2:
                flush_l2()
            sess.run_with_iobinding(io)
        torch.cuda.synchronize()
    kernels = device_events(prof)
    if FLUSH_L2 and kernels:
        # Each Run's events follow its flush's (flush_l2 waits for it): drop them.
        try:
            kernels = [e for share in split_rounds(kernels, runs, FLUSH_EVENTS) for e in share]
        except RuntimeError as e:
            raise RuntimeError(f"--flush-l2: {e} (the flush's)") from None
    per_run = len(kernels) // runs if runs else 0
    if not kernels:  # CUPTI taken by another tool (ncu): wall time, so a profile run still works
        print("  note: no CUPTI kernel records; reporting wall time (not a span)", file=sys.stderr)
        return [wall_ms(sess, io, 1) for _ in range(runs)], {}
    if per_run == 0 or per_run * runs != len(kernels):  # no fixed kernel set per Run: the mean
        print(
            f"  note: {len(kernels)} kernels over {runs} runs; reporting the mean of the kernel "
            "sums (not a span)",
            file=sys.stderr,
        )
        return [sum(e.device_time_total for e in kernels) / 1e3 / max(runs, 1)] * runs, {}

    def run_ms(run: list) -> float:
        if SPAN:
            return (max(e.time_range.end for e in run) - min(e.time_range.start for e in run)) / 1e3
        return sum(e.device_time_total for e in run) / 1e3

    times = [run_ms(kernels[i * per_run : (i + 1) * per_run]) for i in range(runs)]
    per_name: dict[str, float] = {}
    for e in kernels:
        per_name[e.name] = per_name.get(e.name, 0.0) + e.device_time_total / runs
    return times, per_name


def wall_ms(sess, io, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run_with_iobinding(io)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def in_layout(t, layout: int):
    """A logical (B, Nkv, C, H) CUDA tensor -> a buffer of the same declared shape holding the
    bytes of `layout`, placed through layout.py's strides (the one owner of that arithmetic)."""
    import torch

    b, nkv, c, h = t.shape
    st = kv_strides(layout, nkv, c, h)
    buf = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    buf.as_strided(t.shape, (st.batch, st.head, st.seq, st.dim)).copy_(t)
    return buf.view(b, nkv, c, h)


def rotary_caches(positions: int, head_size: int, device: str) -> dict:
    """cos/sin caches (positions, head_size / 2), fp16, of the usual 10000-based frequencies."""
    import torch

    inv = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    ang = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
    return {
        "cos_cache": torch.cos(ang).to(device=device, dtype=torch.float16),
        "sin_cache": torch.sin(ang).to(device=device, dtype=torch.float16),
    }


def step_feeds(q, k, v, length: int, positions: int, head_size: int, device: str) -> dict:
    """The inputs every variant of a case shares: q, k, v, the lengths of a cache of `length`
    rows per batch entry, and with --rotary the cos/sin caches of `positions` positions."""
    import torch

    feeds = {
        "query": q, "key": k, "value": v,
        "seqlens_k": torch.full((q.shape[0],), length - 1, dtype=torch.int32, device=device),
        "total_sequence_length": np.array(length, np.int32),
    }  # fmt: skip
    if ROTARY:
        feeds.update(rotary_caches(positions, head_size, device))
    return feeds


def run_case(kind: str, b: int, length: int, heads: tuple[int, int, int], runs: int, gen) -> dict:
    import torch

    n, nkv, h = heads
    s = 1 if kind == "decode" else length
    f16, dev = torch.float16, "cuda"

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(f16)

    q, k, v = randn(b, s, n * h), randn(b, s, nkv * h), randn(b, s, nkv * h)
    cap = max(CAPACITY, length) if kind == "decode" else length
    pk, pv = randn(b, nkv, cap, h), randn(b, nkv, cap, h)  # rows past L: live data of nobody
    base = step_feeds(q, k, v, length, cap + s, h, dev)
    row = {"kind": kind, "batch": b, "length": length, "capacity": cap, "heads": f"{n}/{nkv}/{h}"}
    if ROTARY:
        row["rotary"] = True
    of = {"ort": ("com.microsoft", None), "kv0": (ort_kvlayout.DOMAIN, 0),
          "kv1": (ort_kvlayout.DOMAIN, 1)}  # fmt: skip

    def start(domain: str, layout: int | None, past: tuple) -> tuple:
        feeds = dict(base)
        feeds["past_key"] = in_layout(past[0], layout or 0)
        feeds["past_value"] = in_layout(past[1], layout or 0)
        sess = session(build_model(domain, n, nkv, layout, rotary=ROTARY))
        io, keep = bind(sess, feeds, shared=kind == "decode")
        for _ in range(3):
            sess.run_with_iobinding(io)
        return sess, io, keep, feeds

    # --rounds R: the three variants take turns, R rounds of runs / R timed Runs each (the order
    # reversed every other round), so a drift of the clocks or the machine over the case weighs
    # on all three alike; each turn starts with two untimed Runs, which leave the L2 holding
    # what back-to-back calls of that variant leave there. A variant's session is made (and
    # warmed up) at its first turn and kept through the case. R = 1: each variant's Runs in one
    # block, in --order (ORT's first by default).
    live: dict[str, tuple] = {}
    times: dict[str, list[float]] = {label: [] for label in ORDER}
    per_kernel: dict[str, dict[str, float]] = {label: {} for label in ORDER}
    for label, n_runs in turns(ORDER, runs, ROUNDS):
        if label not in live:
            live[label] = start(*of[label], (pk, pv))
        sess, io = live[label][:2]
        for _ in range(2):
            sess.run_with_iobinding(io)
        t, names = kernel_times(sess, io, n_runs)
        times[label] += t
        for name, us in names.items():
            per_kernel[label][name] = per_kernel[label].get(name, 0.0) + us * n_runs / runs
    outputs = {}
    for label in ORDER:
        outputs[label] = live[label][2]["output"].float()
        if BREAKDOWN:
            top = sorted(per_kernel[label].items(), key=lambda kv: -kv[1])[:6]
            print(f"  {kind} {row['heads']} B={b} L={length} C={cap} {label}: "
                  + ", ".join(f"{name[:60]} {us:.1f} us" for name, us in top), file=sys.stderr)  # fmt: skip
        t = statistics.median(times[label])
        cell = {"kernel_ms": t, "kernel_ms_p10_p90": np.percentile(times[label], [10, 90]).tolist()}
        if BREAKDOWN:  # the mean us per Run of each kernel, as printed above
            cell["kernels_us"] = dict(top)
        if kind == "decode":
            cell["TB/s"] = kv_read_bytes(b, nkv, length, h) / (t * 1e-3) / 1e12
        else:
            cell["TFLOP/s"] = 4 * b * n * h * s * (s + 1) / 2 / (t * 1e-3) / 1e12
        row[label] = cell
    del live
    unit = "TB/s" if kind == "decode" else "TFLOP/s"
    row["ratio0"] = row["kv0"][unit] / row["ort"][unit]
    row["ratio1"] = row["kv1"][unit] / row["ort"][unit]
    # Same logical inputs: the three outputs must agree (a benchmark of wrong numbers is no
    # benchmark).
    row["max_abs_diff_vs_ort"] = max(
        float((outputs[v] - outputs["ort"]).abs().max()) for v in ("kv0", "kv1")
    )
    del pk, pv, q, k, v, outputs
    torch.cuda.empty_cache()
    return row


def parse_kv_quant(text: str) -> list[tuple[int, str, str]]:
    """--kv-quant: comma-separated int8|int4|fp8 - per-tensor|per-channel|per-token ->
    [(bits, QUANT_TYPE, cache)]."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.lower().split("-", 1)
        if (
            len(parts) != 2
            or parts[0] not in CACHE_TYPES
            or parts[1] not in ("per-tensor", "per-channel", "per-token")
        ):
            raise ValueError(
                f"--kv-quant: int8|int4|fp8-per-tensor|per-channel|per-token, got {item!r}"
            )
        out.append((4 if parts[0] == "int4" else 8, parts[1].replace("-", "_").upper(), parts[0]))
    return out


QUANT_VARIANTS = ("ort", "kv0", "kv1", "ort_q", "q0", "q1")
QUANT_PLAN_KNOB = "ORT_KVLAYOUT_DECODE_QUANT_PLAN"


def run_knobs() -> dict[str, str]:
    """The library's knobs this run set (ORT_KVLAYOUT_* variables of the environment), by name;
    an unset knob takes its default (docs/KNOBS.md)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("ORT_KVLAYOUT_")}


def run_quant_case(
    b: int, length: int, heads: tuple[int, int, int], quant: tuple[int, str, str], runs: int, gen
) -> dict:
    """One decode case with a quantized cache: ours quantized (q0, q1), ours fp16 (kv0, kv1),
    ORT's quantized (ort_q) and fp16 (ort) GQA, on the same logical inputs (random codes: fp8
    bytes other than NaN; scales of about 3 sigma / the top code, per token a scale cache of
    them), each variant's Runs in one block (in QUANT_VARIANTS order). A variant ORT refuses
    (fp8 maybe, PER_TOKEN always: com.microsoft has no such mode) is recorded as
    {"error": ...}."""
    import torch

    n, nkv, h = heads
    bits, qtype, kind = quant
    row_q = h if bits == 8 else (h + 1) // 2
    dev = "cuda"

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(torch.float16)

    q, k, v = randn(b, 1, n * h), randn(b, 1, nkv * h), randn(b, 1, nkv * h)
    cap = max(CAPACITY, length)
    pk, pv = randn(b, nkv, cap, h), randn(b, nkv, cap, h)
    lo, hi = (-127, 128) if kind == "int8" else (0, 256)
    qdt = torch.int8 if kind == "int8" else torch.uint8
    ck = torch.randint(lo, hi, (b, nkv, cap, row_q), generator=gen, device=dev).to(qdt)
    cv = torch.randint(lo, hi, (b, nkv, cap, row_q), generator=gen, device=dev).to(qdt)
    if kind == "fp8":  # no NaN bytes (0x7f, 0xff): their neighbours
        ck[(ck & 0x7F) == 0x7F] -= 1
        cv[(cv & 0x7F) == 0x7F] -= 1
    top = 3.0 / {"int8": 127.0, "int4": 7.0, "fp8": 448.0}[kind]
    if qtype == "PER_TOKEN":
        u = torch.rand(2, b, nkv, cap, generator=gen, device=dev, dtype=torch.float32)
        scales = {SCALE_CACHES[0]: top * (0.5 + u[0]), SCALE_CACHES[1]: top * (0.5 + u[1])}
    elif qtype == "PER_TENSOR":
        scales = {"kv_scale": torch.full((1,), top, dtype=torch.float32, device=dev)}
    else:
        u = torch.rand(2, 1, nkv, 1, h, generator=gen, device=dev, dtype=torch.float32)
        scales = {"k_scale": top * (0.5 + u[0]), "v_scale": top * (0.5 + u[1])}
    base = step_feeds(q, k, v, length, cap + 1, h, dev)
    scheme = f"{kind}-{qtype.lower().replace('_', '-')}"
    types = (
        {"past_key": CACHE_TYPES["fp8"], "past_value": CACHE_TYPES["fp8"]}
        if kind == "fp8"
        else None
    )
    row = {"kind": "decode", "batch": b, "length": length, "capacity": cap,
           "heads": f"{n}/{nkv}/{h}", "kv_quant": scheme}  # fmt: skip
    if ROTARY:
        row["rotary"] = True
    of = {"ort": ("com.microsoft", None, None), "kv0": (ort_kvlayout.DOMAIN, 0, None),
          "kv1": (ort_kvlayout.DOMAIN, 1, None), "ort_q": ("com.microsoft", None, quant),
          "q0": (ort_kvlayout.DOMAIN, 0, quant), "q1": (ort_kvlayout.DOMAIN, 1, quant)}  # fmt: skip
    outputs = {}
    for label in QUANT_VARIANTS:
        domain, layout, qv = of[label]
        feeds = dict(base)
        past = (pk, pv) if qv is None else (ck, cv)
        feeds["past_key"] = in_layout(past[0], layout or 0)
        feeds["past_value"] = in_layout(past[1], layout or 0)
        if qv is not None:
            feeds.update(scales)
        try:
            if qv is not None and qtype == "PER_TOKEN" and domain != ort_kvlayout.DOMAIN:
                raise RuntimeError("com.microsoft GroupQueryAttention has no PER_TOKEN mode")
            sess = session(build_model(domain, n, nkv, layout, rotary=ROTARY, quant=qv))
            io, keep = bind(sess, feeds, shared=True, types=types if qv is not None else None)
            for _ in range(5):
                sess.run_with_iobinding(io)
            t, names = kernel_times(sess, io, runs)
        except Exception as e:  # noqa: BLE001 - ORT's refusal of a case is a result
            row[label] = {"error": str(e)[-300:]}
            print(f"  {scheme} {row['heads']} B={b} L={length} {label}: {str(e)[-200:]}",
                  file=sys.stderr)  # fmt: skip
            continue
        outputs[label] = keep["output"].float()
        if BREAKDOWN:
            top6 = sorted(names.items(), key=lambda kv: -kv[1])[:6]
            print(f"  decode {row['heads']} B={b} L={length} {scheme} {label}: "
                  + ", ".join(f"{nm[:60]} {us:.1f} us" for nm, us in top6), file=sys.stderr)  # fmt: skip
        med = statistics.median(t)
        bytes_read = kv_read_bytes(b, nkv, length, h) * (1 if qv is None else bits / 16)
        row[label] = {"kernel_ms": med, "kernel_ms_p10_p90": np.percentile(t, [10, 90]).tolist(),
                      "TB/s": bytes_read / (med * 1e-3) / 1e12}  # fmt: skip
        if BREAKDOWN:  # the mean us per Run of each kernel, as printed above
            row[label]["kernels_us"] = dict(top6)
        del sess, io, keep, feeds
    ms = {v: row[v]["kernel_ms"] for v in QUANT_VARIANTS if "kernel_ms" in row.get(v, {})}
    row["q_vs_fp16"] = {f"q{x}": ms[f"q{x}"] / ms[f"kv{x}"] for x in (0, 1)
                        if f"q{x}" in ms and f"kv{x}" in ms}  # fmt: skip
    row["q_speedup_vs_ort_q"] = {f"q{x}": ms["ort_q"] / ms[f"q{x}"] for x in (0, 1)
                                 if f"q{x}" in ms and "ort_q" in ms}  # fmt: skip
    # Same codes and scales: ours and ORT's quantized outputs must agree (fp16 tolerance).
    if "ort_q" in outputs:
        row["max_abs_diff_q_vs_ort_q"] = max(
            (float((outputs[x] - outputs["ort_q"]).abs().max()) for x in ("q0", "q1")
             if x in outputs), default=None)  # fmt: skip
    if "q0" in outputs and "q1" in outputs:
        row["max_abs_diff_q0_vs_q1"] = float((outputs["q0"] - outputs["q1"]).abs().max())
    del pk, pv, ck, cv, q, k, v, outputs
    torch.cuda.empty_cache()
    return row


def print_quant_rows(rows: list[dict]) -> None:
    print(
        "| case | heads | scheme | ORT fp16 | ORT quantized | ours fp16 L0 | ours quant L0 "
        "| ours fp16 L1 | ours quant L1 | quant/fp16 L0 | quant/fp16 L1 | vs ORT quant L0 "
        "| vs ORT quant L1 | max diff vs ORT quant |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def cell(c):
        return f"{c['kernel_ms'] * 1e3:.1f} us" if "kernel_ms" in c else "refused"

    for r in rows:
        name = f"decode B={r['batch']} L={r['length']}" + (" rotary" if r.get("rotary") else "")
        cells = [cell(r[v]) for v in ("ort", "ort_q", "kv0", "q0", "kv1", "q1")]
        qf, so = r["q_vs_fp16"], r["q_speedup_vs_ort_q"]
        ratios = [f"{d[x]:.2f}" if x in d else "-" for d in (qf, so) for x in ("q0", "q1")]
        diff = r.get("max_abs_diff_q_vs_ort_q")
        print(f"| {name} | {r['heads']} | {r['kv_quant']} | {' | '.join(cells)} | "
              f"{' | '.join(ratios)} | {'-' if diff is None else f'{diff:.1e}'} |", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="32/8/128,28/4/128,9/3/64,4/1/256")
    p.add_argument("--decode", default=",".join(
        f"{b}x{n}" for b in (1, 8, 32, 64) for n in (1024, 4096, 16384, 32768)))  # fmt: skip
    p.add_argument("--prefill", default=",".join(
        f"{b}x{n}" for b in (1, 4) for n in (512, 2048, 8192)))  # fmt: skip
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--library", default=None, help="load this libort_kvlayout.so instead")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="per-kernel times (stderr, and each cell's kernels_us in the JSON)",
    )
    p.add_argument(
        "--span", action="store_true", help="first kernel start to last kernel end per Run"
    )
    p.add_argument("--capacity", type=int, default=0, help="decode cache rows (0: L)")
    p.add_argument("--rotary", action="store_true", help="do_rotary=1 with cos/sin caches")
    p.add_argument("--flush-l2", action="store_true",
                   help="read a buffer of twice the L2 before each timed Run (not counted)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1,
                   help="interleave the three variants' timed Runs in this many rounds")  # fmt: skip
    p.add_argument("--order", default=",".join(VARIANTS),
                   help="the variants' order: sessions and caches made, turns taken")  # fmt: skip
    p.add_argument("--kv-quant", default="",
                   help="quantized decode schemes, e.g. int8-per-channel,int4-per-tensor")  # fmt: skip
    p.add_argument("--quant-plan", choices=("bytes", "fp16"), default=None,
                   help="set ORT_KVLAYOUT_DECODE_QUANT_PLAN for this run")  # fmt: skip
    args = p.parse_args(argv)
    if args.quant_plan is not None:
        held = os.environ.get(QUANT_PLAN_KNOB, "")
        if held not in ("", args.quant_plan):
            p.error(f"--quant-plan {args.quant_plan}, but {QUANT_PLAN_KNOB}={held} is set")
        # Before the first session: the library reads its knobs once, at its first CUDA op.
        os.environ[QUANT_PLAN_KNOB] = args.quant_plan
    try:
        kv_quant = parse_kv_quant(args.kv_quant)
    except ValueError as e:
        p.error(str(e))
    global LIBRARY, BREAKDOWN, SPAN, CAPACITY, ROTARY, ROUNDS, FLUSH_L2, FLUSH_EVENTS, ORDER
    LIBRARY, BREAKDOWN, SPAN, CAPACITY = args.library, args.breakdown, args.span, args.capacity
    ROTARY, ROUNDS, FLUSH_L2 = args.rotary, args.rounds, args.flush_l2
    try:
        ORDER = parse_order(args.order)
    except ValueError as e:
        p.error(str(e))
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("CUDAExecutionProvider not available", file=sys.stderr)
        return 2
    import torch

    if FLUSH_L2:
        FLUSH_EVENTS = flush_events()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows, quant_rows = [], []
    for heads_text in filter(None, args.heads.split(",")):
        heads = tuple(int(x) for x in heads_text.split("/"))
        for spec in filter(None, args.decode.split(",")):
            b, length = (int(x) for x in spec.split("x"))
            if kv_quant:  # the quantized comparison replaces the fp16 one (it holds it)
                for quant in kv_quant:
                    quant_rows.append(run_quant_case(b, length, heads, quant, args.runs, gen))
                continue
            rows.append(run_case("decode", b, length, heads, args.runs, gen))
        for spec in filter(None, args.prefill.split(",")):
            b, length = (int(x) for x in spec.split("x"))
            rows.append(run_case("prefill", b, length, heads, args.runs, gen))
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# CUDA GQA benchmark, {date}, onnxruntime {ort.__version__}, fp16")
    print(f"command: python {' '.join(sys.argv)}")
    knobs = run_knobs()
    if knobs:
        print("knobs: " + " ".join(f"{k}={v}" for k, v in knobs.items()))
    if LIBRARY:
        print(f"library: {LIBRARY}")
    if quant_rows:
        print_quant_rows(quant_rows)
    print(
        "| case | heads | ORT built-in | ours kv_layout=0 | ours kv_layout=1 | ratio 0 | ratio 1 "
        "| kv1/kv0 time | max diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        unit = "TB/s" if r["kind"] == "decode" else "TFLOP/s"
        # Microseconds with one decimal: a decode call of 8 to 20 us differs by tenths.
        cells = [
            f"{r[v][unit]:.2f} {unit} ({r[v]['kernel_ms'] * 1e3:.1f} us)"
            for v in ("ort", "kv0", "kv1")
        ]
        name = f"{r['kind']} B={r['batch']} {'L' if r['kind'] == 'decode' else 'S'}={r['length']}"
        if r["capacity"] != r["length"]:
            name += f" C={r['capacity']}"
        if r.get("rotary"):
            name += " rotary"
        skew = r["kv1"]["kernel_ms"] / r["kv0"]["kernel_ms"]
        print(
            f"| {name} | {r['heads']} | {' | '.join(cells)} | {r['ratio0']:.2f} | {r['ratio1']:.2f} "
            f"| {skew:.3f} | {r['max_abs_diff_vs_ort']:.1e} |",
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"date": date, "onnxruntime": ort.__version__, "device": torch.cuda.get_device_name(),
                "command": "python " + " ".join(sys.argv), "git": git_revision(), "runs": args.runs,
                "rounds": ROUNDS, "flush_l2": FLUSH_L2, "order": list(ORDER),
                "knobs": knobs}  # fmt: skip
        if quant_rows:
            meta["kv_quant"] = args.kv_quant
        args.json.write_text(json.dumps({**meta, "rows": rows + quant_rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
