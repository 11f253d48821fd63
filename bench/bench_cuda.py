"""CUDA benchmark: ai.kvlayout::GroupQueryAttention (kv_layout 0 and 1) vs ORT's built-in
com.microsoft::GroupQueryAttention on the CUDA EP, fp16, in one process.

Each case builds three single-node models on the same logical inputs and runs them through IO
binding with every tensor on the GPU. Decode binds one buffer as past and present (the shared,
in-place cache onnxruntime-genai uses; capacity = L). Kernel time is measured with CUPTI through
torch.profiler (the sum of the device kernels of one Run; ORT's per-Run host overhead of
~100 us is excluded); the wall time of Run is reported beside it.

Metrics: decode GB/s of KV read = 2 * B * Nkv * L * H * 2 bytes / kernel time;
prefill TFLOP/s with causal flops = 4 * B * N * H * S*(S+1)/2.

  python bench/bench_cuda.py                 # default cases
  python bench/bench_cuda.py --decode 64x16384 --prefill ""
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import ort_kvlayout
from onnx import TensorProto, helper
from ort_kvlayout.layout import to_layout

INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length")
OUTPUTS = ("output", "present_key", "present_value")


def build_model(domain: str, n: int, nkv: int, layout: int | None) -> bytes:
    f16 = TensorProto.FLOAT16
    ins = [helper.make_tensor_value_info(name, f16, None) for name in INPUTS[:5]]
    ins += [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    attrs = {"num_heads": n, "kv_num_heads": nkv}
    if layout is not None:
        attrs["kv_layout"] = layout
    node = helper.make_node("GroupQueryAttention", list(INPUTS), list(OUTPUTS), domain=domain,
                            **attrs)  # fmt: skip
    outs = [helper.make_tensor_value_info(name, f16, None) for name in OUTPUTS]
    graph = helper.make_graph([node], "gqa", ins, outs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)]
    )
    model.ir_version = 10
    return model.SerializeToString()


LIBRARY: str | None = None  # --library: a libort_kvlayout.so to load instead of the package's
BREAKDOWN = False  # --breakdown: per-kernel device times on stderr


def session(model: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    if LIBRARY:
        so.register_custom_ops_library(LIBRARY)
    else:
        ort_kvlayout.register(so)
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CUDAExecutionProvider"])


def bind(sess, feeds: dict, shared: bool):
    io = sess.io_binding()
    keep = {}
    for name, arr in feeds.items():
        device = "cpu" if name == "total_sequence_length" else "cuda"
        keep[name] = ort.OrtValue.ortvalue_from_numpy(arr, device, 0)
        io.bind_ortvalue_input(name, keep[name])
    b, s = feeds["query"].shape[:2]
    out = np.zeros((b, s, feeds["query"].shape[2]), np.float16)
    keep["output"] = ort.OrtValue.ortvalue_from_numpy(out, "cuda", 0)
    io.bind_ortvalue_output("output", keep["output"])
    for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
        if shared:
            io.bind_ortvalue_output(present, keep[past])
        else:
            io.bind_output(present, "cuda", 0)
    return io, keep


def kernel_ms(sess, io, runs: int) -> tuple[float | None, dict[str, float]]:
    """Device time of one Run (ms), and per kernel name (us per Run)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None, {}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            sess.run_with_iobinding(io)
        torch.cuda.synchronize()
    per = {
        e.key: e.device_time_total / runs
        for e in prof.key_averages()
        if e.device_time_total > 0 and e.count
    }
    return sum(per.values()) / 1e3, per


def wall_ms(sess, io, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run_with_iobinding(io)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run_case(kind: str, b: int, length: int, heads: tuple[int, int, int], runs: int, rng) -> dict:
    n, nkv, h = heads
    s = 1 if kind == "decode" else length
    f16 = np.float16
    q = rng.standard_normal((b, s, n * h)).astype(f16)
    k = rng.standard_normal((b, s, nkv * h)).astype(f16)
    v = rng.standard_normal((b, s, nkv * h)).astype(f16)
    cap = length
    pk = rng.standard_normal((b, nkv, cap, h)).astype(f16)
    pv = rng.standard_normal((b, nkv, cap, h)).astype(f16)
    base = {
        "query": q, "key": k, "value": v,
        "seqlens_k": np.full(b, length - 1, np.int32),
        "total_sequence_length": np.array(length, np.int32),
    }  # fmt: skip
    row = {"kind": kind, "batch": b, "length": length, "heads": f"{n}/{nkv}/{h}"}
    for label, domain, layout in (
        ("ort", "com.microsoft", None),
        ("kv0", ort_kvlayout.DOMAIN, 0),
        ("kv1", ort_kvlayout.DOMAIN, 1),
    ):
        feeds = dict(base)
        feeds["past_key"] = to_layout(pk, layout or 0)
        feeds["past_value"] = to_layout(pv, layout or 0)
        sess = session(build_model(domain, n, nkv, layout))
        io, keep = bind(sess, feeds, shared=kind == "decode")
        for _ in range(3):
            sess.run_with_iobinding(io)
        kms, per_kernel = kernel_ms(sess, io, runs)
        wms = wall_ms(sess, io, runs)
        if BREAKDOWN:
            top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6]
            print(f"  {kind} B={b} L={length} {label}: "
                  + ", ".join(f"{name[:60]} {us:.1f} us" for name, us in top), file=sys.stderr)  # fmt: skip
        t = kms if kms else wms
        if kind == "decode":
            metric = 2 * b * nkv * length * h * 2 / (t * 1e-3) / 1e12
            row[label] = {"kernel_ms": kms, "wall_ms": wms, "TB/s": metric}
        else:
            flops = 4 * b * n * h * s * (s + 1) / 2
            row[label] = {"kernel_ms": kms, "wall_ms": wms, "TFLOP/s": flops / (t * 1e-3) / 1e12}
        del keep
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="32/8/128")
    p.add_argument("--decode", default="1x4096,16x4096,64x4096,16x16384")
    p.add_argument("--prefill", default="1x2048,1x8192")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--library", default=None, help="load this libort_kvlayout.so instead")
    p.add_argument("--breakdown", action="store_true", help="per-kernel times (stderr)")
    args = p.parse_args(argv)
    global LIBRARY, BREAKDOWN
    LIBRARY, BREAKDOWN = args.library, args.breakdown
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("CUDAExecutionProvider not available", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    rows = []
    for heads_text in filter(None, args.heads.split(",")):
        heads = tuple(int(x) for x in heads_text.split("/"))
        for spec in filter(None, args.decode.split(",")):
            b, length = (int(x) for x in spec.split("x"))
            rows.append(run_case("decode", b, length, heads, args.runs, rng))
        for spec in filter(None, args.prefill.split(",")):
            b, length = (int(x) for x in spec.split("x"))
            rows.append(run_case("prefill", b, length, heads, args.runs, rng))
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# CUDA GQA benchmark, {date}, onnxruntime {ort.__version__}, fp16")
    print(f"command: python {' '.join(sys.argv)}")
    if LIBRARY:
        print(f"library: {LIBRARY}")
    print(
        "| case | heads | ORT built-in | ours kv_layout=0 | ours kv_layout=1 | ratio 0 | ratio 1 |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        unit = "TB/s" if r["kind"] == "decode" else "TFLOP/s"
        cells = [f"{r[v][unit]:.2f} {unit} ({r[v]['kernel_ms'] or r[v]['wall_ms']:.3f} ms)"
                 for v in ("ort", "kv0", "kv1")]  # fmt: skip
        ratios = [r[v][unit] / r["ort"][unit] for v in ("kv0", "kv1")]
        name = f"{r['kind']} B={r['batch']} L={r['length']}"
        print(
            f"| {name} | {r['heads']} | {' | '.join(cells)} | {ratios[0]:.2f} | {ratios[1]:.2f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": date, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
