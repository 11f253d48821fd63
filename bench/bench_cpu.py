"""CPU benchmark: ai.kvlayout::GroupQueryAttention (kv_layout 0 and 1) vs ORT's built-in
com.microsoft::GroupQueryAttention, fp32, in one process, interleaved.

Quantized caches (``--kv-quant int8-per-channel`` etc.): every variant runs ORT 1.32's quantized
contract (int8 or packed int4 cache, static float32 scales as initializers); the extra variant
``kv1plain`` is ours with the unquantized float32 cache in the same run, so the table shows both
ours/ORT (quantized against quantized) and what the narrow cache buys over the plain one. Decode
GB/s then counts the bytes of the cache as stored (1 byte an element for int8, 1/2 for int4).

For every case three single-node models are built (ORT built-in, ours with kv_layout=0, ours with
kv_layout=1) on the same random inputs (the layout-1 past is the same logical cache permuted).
Inputs are pre-bound as CPU OrtValues and outputs bound to preallocated OrtValues (IO binding),
so each timed call is one ``run_with_iobinding``. Repetitions go round-robin over the variants
(the starting variant rotates) so machine noise hits all of them alike.

Metrics:
  decode  (S=1, past of total-1 rows, non-shared "dynamic" cache unless --kv-mode shared):
          GB/s of KV read = 2 * B * Nkv * L * H * 4 bytes / median time (L = total length).
  prefill (first prompt, no past): GFLOP/s with causal flops = 4 * B * N * H * S*(S+1)/2
          (QK^T and PV over the causal triangle only, diagonal included).

CPU kernel levels: the library carries portable, AVX2 and AVX-512 kernels and uses one per
process (ORT_KVLAYOUT_CPU_ISA forces a lower one). By default every level this CPU supports is
measured, each in a child process with ORT beside it, and a table per level is printed;
``--isa avx2`` picks levels, ``--isa current`` measures this process's level only.

Examples:
  python bench/bench_cpu.py                       # the issue's cases (preset "issue"), all levels
  python bench/bench_cpu.py --preset quick        # small shapes, a smoke test
  python bench/bench_cpu.py --heads 32/8/128 --decode 1x4096 --prefill ""
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import ort_kvlayout
from onnx import TensorProto, helper
from ort_kvlayout.op.layout import from_layout, to_layout
from revision import git_revision  # a sibling: bench/revision.py

MS_DOMAIN = "com.microsoft"
KV_DOMAIN = ort_kvlayout.DOMAIN
VARIANTS = ("ort", "kv0", "kv1", "kv1plain")  # ORT built-in, ours layout 0 / 1, ours unquantized
DEFAULT_VARIANTS = ("ort", "kv0", "kv1")
VARIANT_LABELS = {
    "ort": "ORT com.microsoft",
    "kv0": "ours kv_layout=0 (BNSH)",
    "kv1": "ours kv_layout=1 (BSNH)",
    "kv1plain": "ours kv_layout=1, float32 cache",
}
# --kv-quant values: (quant type, bit width). Scales are static float32 initializers.
KV_QUANT = {
    "none": (None, 0),
    "int8-per-tensor": ("PER_TENSOR", 8),
    "int8-per-channel": ("PER_CHANNEL", 8),
    "int4-per-tensor": ("PER_TENSOR", 4),
    "int4-per-channel": ("PER_CHANNEL", 4),
}

PRESETS = {
    # The cases of issue 2: decode B=1/B=4 at L=4096, prefill S=512/2048, two head configs.
    "issue": {"heads": "32/8/128,9/3/64", "decode": "1x4096,4x4096", "prefill": "512,2048"},
    # Small and fast: checks that everything runs.
    "quick": {"heads": "32/8/128,9/3/64", "decode": "1x512", "prefill": "128"},
}

REPO = Path(__file__).resolve().parent.parent
ISA_ENV = "ORT_KVLAYOUT_CPU_ISA"
ISA_LEVELS = ("portable", "avx2", "avx512")


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "prefill"
    batch: int
    seq: int  # S, new rows (query length)
    total: int  # total sequence length L
    past: int  # past buffer rows C (0: no past inputs)
    num_heads: int
    kv_heads: int
    head_size: int
    shared: bool = False  # past and present bound to one OrtValue
    quant: str = "none"  # a KV_QUANT key

    @property
    def quant_type(self) -> str | None:
        return KV_QUANT[self.quant][0]

    @property
    def bits(self) -> int:
        return KV_QUANT[self.quant][1]

    @property
    def cache_row(self) -> int:
        """Stored elements of one cache row (packed int4: two channels a byte)."""
        return (self.head_size + 1) // 2 if self.bits == 4 else self.head_size

    @property
    def cache_elem_bytes(self) -> float:
        return {0: 4.0, 8: 1.0, 4: 0.5}[self.bits]

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode B={self.batch} L={self.total}"
        return f"prefill B={self.batch} S={self.seq}"

    @property
    def heads(self) -> str:
        return f"{self.num_heads}/{self.kv_heads}/{self.head_size}"

    @property
    def present_len(self) -> int:
        return max(self.total, self.past)

    def work(self) -> float:
        """Bytes of KV read (decode) or causal flops (prefill) per call."""
        if self.kind == "decode":
            per_elem = self.cache_elem_bytes
            return 2.0 * self.batch * self.kv_heads * self.total * self.head_size * per_elem
        s = self.seq
        return 4.0 * self.batch * self.num_heads * self.head_size * s * (s + 1) / 2

    @property
    def unit(self) -> str:
        return "GB/s" if self.kind == "decode" else "GFLOP/s"


# ------------------------------------------------------------------------------------------
# Case list
# ------------------------------------------------------------------------------------------
def parse_heads(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        n, nkv, h = (int(x) for x in item.split("/"))
        if n % nkv:
            raise SystemExit(f"--heads {item}: num_heads must be a multiple of kv_num_heads")
        out.append((n, nkv, h))
    return out


def parse_decode(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        b, length = (int(x) for x in item.lower().split("x"))
        out.append((b, length))
    return out


def parse_prefill(text: str) -> list[tuple[int, int]]:
    """'512,2048' or '2x512' (batch x S)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = [int(x) for x in item.lower().split("x")]
        out.append((1, parts[0]) if len(parts) == 1 else (parts[0], parts[1]))
    return out


def build_cases(args) -> list[Case]:
    preset = PRESETS[args.preset]
    heads = parse_heads(args.heads if args.heads is not None else preset["heads"])
    decode = parse_decode(args.decode if args.decode is not None else preset["decode"])
    prefill = parse_prefill(args.prefill if args.prefill is not None else preset["prefill"])
    shared = args.kv_mode == "shared"
    cases = []
    for b, length in decode:
        for n, nkv, h in heads:
            # Contract: a non-shared past is exactly total - S rows ("dynamic cache") or at least
            # total rows; we use the dynamic cache (C = L - 1, present L rows). A shared buffer
            # holds total rows (C = L) and the new row is appended in place.
            past = length if shared else length - 1
            cases.append(Case("decode", b, 1, length, past, n, nkv, h, shared, args.kv_quant))
    for b, s in prefill:
        for n, nkv, h in heads:
            # First prompt: S == total, no past inputs (a quantized node gets a zero-capacity
            # past: ORT types present from past); present holds S rows.
            cases.append(Case("prefill", b, s, s, 0, n, nkv, h, quant=args.kv_quant))
    return cases


# ------------------------------------------------------------------------------------------
# Models, inputs and bindings
# ------------------------------------------------------------------------------------------
def cache_tensor_type(case: Case, quantized: bool) -> int:
    if not quantized or case.bits == 0:
        return TensorProto.FLOAT
    return TensorProto.INT8 if case.bits == 8 else TensorProto.UINT8


def scale_values(case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Static scales: one value (per tensor) or Nkv*H (per channel), in a range that keeps the
    random normal K/V inside the codes without saturating most of them."""
    qmax = 127.0 if case.bits == 8 else 7.0
    count = 1 if case.quant_type == "PER_TENSOR" else case.kv_heads * case.head_size
    shape = [1] if count == 1 else [1, case.kv_heads, 1, case.head_size]
    return {
        kv: (rng.uniform(2.5, 3.5, count) / qmax).astype(np.float32).reshape(shape)
        for kv in ("k_scale", "v_scale")
    }


def build_model(
    case: Case, domain: str, kv_layout: int | None, scales: dict | None = None
) -> bytes:
    """scales: the static k_scale/v_scale values of a quantized case, or None: unquantized."""
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    b, s = case.batch, case.seq
    n, nkv, h = case.num_heads, case.kv_heads, case.head_size
    quantized = scales is not None
    ct = cache_tensor_type(case, quantized)
    row = case.cache_row if quantized else h
    past_rows = case.past if case.past or not quantized else 0
    inputs = [
        helper.make_tensor_value_info("query", f32, [b, s, n * h]),
        helper.make_tensor_value_info("key", f32, [b, s, nkv * h]),
        helper.make_tensor_value_info("value", f32, [b, s, nkv * h]),
    ]
    node_inputs = ["query", "key", "value"]
    if case.past or quantized:
        inputs += [
            helper.make_tensor_value_info("past_key", ct, [b, nkv, past_rows, row]),
            helper.make_tensor_value_info("past_value", ct, [b, nkv, past_rows, row]),
        ]
        node_inputs += ["past_key", "past_value"]
    else:
        node_inputs += ["", ""]
    inputs += [
        helper.make_tensor_value_info("seqlens_k", i32, [b]),
        helper.make_tensor_value_info("total_sequence_length", i32, []),
    ]
    node_inputs += ["seqlens_k", "total_sequence_length"]
    c_out = case.present_len
    outputs = [
        helper.make_tensor_value_info("output", f32, [b, s, n * h]),
        helper.make_tensor_value_info("present_key", ct, [b, nkv, c_out, row]),
        helper.make_tensor_value_info("present_value", ct, [b, nkv, c_out, row]),
    ]
    attrs = {"num_heads": n, "kv_num_heads": nkv}
    if kv_layout is not None:
        attrs["kv_layout"] = kv_layout
    initializers = []
    if quantized:
        attrs.update(
            k_quant_type=case.quant_type, v_quant_type=case.quant_type, kv_cache_bit_width=case.bits
        )
        node_inputs += [""] * (12 - len(node_inputs)) + ["k_scale", "v_scale"]
        initializers = [
            helper.make_tensor(name, f32, list(val.shape), val.ravel().tolist())
            for name, val in scales.items()
        ]
    node = helper.make_node(
        "GroupQueryAttention",
        node_inputs,
        ["output", "present_key", "present_value"],
        domain=domain,
        name="gqa",
        **attrs,
    )
    graph = helper.make_graph([node], "gqa_bench", inputs, outputs, initializer=initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def make_inputs(case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Logical inputs (past in BNSH order); random normal, not zeros."""
    b, s = case.batch, case.seq
    n, nkv, h = case.num_heads, case.kv_heads, case.head_size

    def randn(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    feeds = {
        "query": randn(b, s, n * h),
        "key": randn(b, s, nkv * h),
        "value": randn(b, s, nkv * h),
        "seqlens_k": np.full((b,), case.total - 1, dtype=np.int32),
        "total_sequence_length": np.array(case.total, dtype=np.int32),
    }
    if case.past:
        feeds["past_key"] = randn(b, nkv, case.past, h)
        feeds["past_value"] = randn(b, nkv, case.past, h)
    if case.quant != "none":
        lo, hi = (-127, 128) if case.bits == 8 else (0, 256)  # int8 codes / packed nibble pairs
        dt = np.int8 if case.bits == 8 else np.uint8
        for kv in ("key", "value"):  # random codes: the past as stored
            feeds[f"past_{kv}_q"] = rng.integers(
                lo, hi, (b, nkv, case.past, case.cache_row)
            ).astype(dt)
        feeds["scales"] = scale_values(case, rng)
    return feeds


class Variant:
    """One session with its inputs pre-bound and outputs bound to preallocated OrtValues."""

    def __init__(self, key: str, case: Case, feeds: dict, so_factory, shared_inputs: dict):
        self.key = key
        self.layout = 1 if key in ("kv1", "kv1plain") else 0
        domain = MS_DOMAIN if key == "ort" else KV_DOMAIN
        kv_layout = None if key == "ort" else self.layout
        self.quantized = case.quant != "none" and key != "kv1plain"
        scales = feeds["scales"] if self.quantized else None
        so = so_factory(domain)
        self.sess = ort.InferenceSession(
            build_model(case, domain, kv_layout, scales), so, providers=["CPUExecutionProvider"]
        )
        self.io = self.sess.io_binding()
        self._keep = []  # numpy buffers behind the OrtValues (OrtValue does not own them)

        def ortvalue(arr: np.ndarray) -> ort.OrtValue:
            self._keep.append(arr)
            return ort.OrtValue.ortvalue_from_numpy(arr)

        # Read-only inputs: reuse one OrtValue per (name, layout) across variants.
        for name in ("query", "key", "value", "seqlens_k", "total_sequence_length"):
            if name not in shared_inputs:
                shared_inputs[name] = ortvalue(feeds[name])
            self.io.bind_ortvalue_input(name, shared_inputs[name])
        b, s, nh = feeds["query"].shape
        row = case.cache_row if self.quantized else case.head_size
        cache_dtype = feeds["past_key_q"].dtype if self.quantized else np.float32
        past_name = "past_{}_q" if self.quantized else "past_{}"
        present_shape = (case.batch, case.kv_heads, case.present_len, row)
        self.output = np.empty((b, s, nh), dtype=np.float32)
        self.io.bind_ortvalue_output("output", ortvalue(self.output))
        if self.quantized and not case.past:  # the zero-capacity past of a quantized prompt
            for kv in ("key", "value"):
                empty = np.empty((case.batch, case.kv_heads, 0, row), dtype=cache_dtype)
                self.io.bind_ortvalue_input(f"past_{kv}", ortvalue(empty))
        if case.shared:
            # One buffer per variant: past and present are the same memory (append in place).
            self.present = {}
            for kv in ("key", "value"):
                buf = to_layout(feeds[past_name.format(kv)], self.layout).copy()
                v = ortvalue(buf)
                self.present[kv] = buf
                self.io.bind_ortvalue_input(f"past_{kv}", v)
                self.io.bind_ortvalue_output(f"present_{kv}", v)
            return
        if case.past:
            for kv in ("key", "value"):
                tag = (past_name.format(kv), self.layout)
                if tag not in shared_inputs:
                    past = to_layout(feeds[past_name.format(kv)], self.layout)
                    shared_inputs[tag] = ortvalue(past)
                self.io.bind_ortvalue_input(f"past_{kv}", shared_inputs[tag])
        self.present = {}
        for kv in ("key", "value"):
            buf = np.empty(present_shape, dtype=cache_dtype)
            self.present[kv] = buf
            self.io.bind_ortvalue_output(f"present_{kv}", ortvalue(buf))

    def run(self) -> int:
        t0 = time.perf_counter_ns()
        self.sess.run_with_iobinding(self.io)
        return time.perf_counter_ns() - t0

    def logical_present(self, kv: str, rows: int) -> np.ndarray:
        return from_layout(self.present[kv], self.layout)[:, :, :rows, :]


# ------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------
def check_agreement(variants: dict[str, Variant], case: Case) -> dict[str, float]:
    """Max |ours - ORT| over output and the defined present rows, per variant."""
    ref = variants.get("ort")
    if ref is None:
        return {}
    out = {}
    for key, v in variants.items():
        if key == "ort" or v.quantized != ref.quantized:
            continue  # the plain cache answers another question: no agreement to check
        d = float(np.max(np.abs(v.output - ref.output)))
        for kv in ("key", "value"):  # quantized: codes, compared as integers
            a = v.logical_present(kv, case.total).astype(np.float64)
            r = ref.logical_present(kv, case.total).astype(np.float64)
            d = max(d, float(np.max(np.abs(a - r))))
        out[key] = d
    return out


def measure(variants: dict[str, Variant], args) -> dict[str, list[int]]:
    keys = list(variants)
    # Warm-up: at least args.warmup calls each and ~0.2 s in total, round-robin.
    est = {k: [] for k in keys}
    t_start = time.perf_counter()
    i = 0
    while i < args.warmup or (time.perf_counter() - t_start < 0.2 and i < 50):
        for k in keys:
            est[k].append(variants[k].run())
        i += 1
    per_call = {k: float(np.median(v[-max(1, len(v) // 2) :])) for k, v in est.items()}
    reps = max(args.min_reps, max(math.ceil(args.min_time * 1e9 / t) for t in per_call.values()))
    reps = min(reps, max(args.max_reps, args.min_reps))
    times = {k: [] for k in keys}
    for r in range(reps):
        for j in range(len(keys)):  # rotate the starting variant each repetition
            k = keys[(r + j) % len(keys)]
            times[k].append(variants[k].run())
    return times


def cpu_snapshot() -> tuple[float, float, float]:
    """(busy CPU seconds of the whole machine, this process's CPU seconds, wall seconds)."""
    busy = float("nan")
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
        busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError):
        pass
    return busy, time.process_time(), time.perf_counter()


def other_load(before: tuple, after: tuple) -> float:
    """CPUs' worth of work done by other processes between two snapshots (0 = machine idle)."""
    wall = after[2] - before[2]
    return ((after[0] - before[0]) - (after[1] - before[1])) / wall if wall > 0 else float("nan")


def summarize(case: Case, times_ns: list[int]) -> dict:
    t = np.asarray(times_ns, dtype=np.float64) / 1e9
    med, p10, p90 = (float(np.percentile(t, q)) for q in (50, 10, 90))
    w = case.work() / 1e9
    return {
        "reps": len(times_ns),
        "median_ms": med * 1e3,
        "p10_ms": p10 * 1e3,
        "p90_ms": p90 * 1e3,
        "throughput": w / med,
        "throughput_p10": w / p90,  # slow end
        "throughput_p90": w / p10,  # fast end
        "unit": case.unit,
    }


# ------------------------------------------------------------------------------------------
# Environment, report
# ------------------------------------------------------------------------------------------
def machine_info() -> dict:
    info = {"model_name": platform.processor() or "unknown", "logical_cpus": os.cpu_count()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = {
            k.strip(): v.strip()
            for k, v in (ln.split(":", 1) for ln in lscpu.splitlines() if ":" in ln)
        }
        info["model_name"] = fields.get("Model name", info["model_name"])
        cores = int(fields.get("Core(s) per socket", 0)) * int(fields.get("Socket(s)", 1))
        info["physical_cores"] = cores or None
        info["threads_per_core"] = int(fields.get("Thread(s) per core", 1))
        info["l3"] = fields.get("L3 cache")
    except (OSError, subprocess.CalledProcessError, ValueError):
        pass
    try:  # the vector ISA extensions the kernels' levels depend on
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
        wanted = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512")
        info["isa_flags"] = " ".join(x for x in flags if x.startswith(wanted))
    except OSError:
        pass
    return info


def library_info() -> dict:
    info = {"version": ort_kvlayout.__version__}
    try:
        path = ort_kvlayout.library_path()
        info["library"] = path
        info["library_sha256"] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
        info.update({f"build_{k}": v for k, v in ort_kvlayout.build_info().items()})
    except Exception as e:  # noqa: BLE001 - informational only
        info["error"] = f"{type(e).__name__}: {e}"
    revision = git_revision()
    if revision != "unknown":
        info["git"] = revision
    return info


def fmt_tp(s: dict) -> str:
    return f"{s['throughput']:.1f} [{s['throughput_p10']:.1f}, {s['throughput_p90']:.1f}]"


def markdown_table(results: list[dict], keys: list[str]) -> str:
    head = ["case", "N/Nkv/H", "unit"]
    for k in keys:
        head.append(VARIANT_LABELS[k])
        if k != "ort" and "ort" in keys:
            head.append(f"{k}/ORT")
    head += [f"{k} ms" for k in keys] + ["reps", "other load", "max abs diff vs ORT"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in results:
        st = r["stats"]
        row = [r["case"]["name"], r["case"]["heads"], st[keys[0]]["unit"]]
        for k in keys:
            row.append(fmt_tp(st[k]))
            if k != "ort" and "ort" in keys:
                row.append(f"{r['ratio'][k]:.2f}x")
        row += [f"{st[k]['median_ms']:.3f}" for k in keys]
        row.append(str(st[keys[0]]["reps"]))
        row.append(f"{r['other_processes_cpus']:.2f}")
        row.append(", ".join(f"{k} {d:.1e}" for k, d in r["max_abs_diff"].items()) or "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def supported_levels() -> list[str]:
    """CPU kernel levels built into the library that this CPU supports, lowest first."""
    info = ort_kvlayout.build_info()
    best = ISA_LEVELS.index(info["cpu_isa_best"])
    return [lv for lv in info["cpu_isas"] if ISA_LEVELS.index(lv) <= best]


def level_table(per_level: dict[str, list[dict]], keys: list[str]) -> str:
    """One row per (case, level): throughput of each variant and the ratios to ORT."""
    ours = [k for k in keys if k != "ort"]
    head = ["case", "N/Nkv/H", "level", "unit"] + [VARIANT_LABELS[k] for k in keys]
    if "ort" in keys:
        head += [f"{k}/ORT" for k in ours]
    head += ["other load"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    levels = list(per_level)
    for i, first in enumerate(per_level[levels[0]]):
        for level in levels:
            r = per_level[level][i]
            st = r["stats"]
            row = [first["case"]["name"], first["case"]["heads"], level, st[keys[0]]["unit"]]
            row += [f"{st[k]['throughput']:.1f}" for k in keys]
            if "ort" in keys:
                row += [f"{r['ratio'][k]:.2f}x" for k in ours]
            row.append(f"{r['other_processes_cpus']:.2f}")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def run_levels(levels: list[str], argv: list[str], keys: list[str], json_path: str) -> int:
    """Runs this script once per level in a child process (the level is fixed per process),
    then prints the per-level comparison and writes one JSON holding every level's run."""
    import tempfile

    per_level: dict[str, list[dict]] = {}
    metas: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for level in levels:
            out = Path(tmp) / f"{level}.json"
            env = {**os.environ, ISA_ENV: level}
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--isa", "current"]
            print(f"\n## level {level} ({ISA_ENV}={level})", flush=True)
            rc = subprocess.run([*cmd, "--json", str(out)], env=env, check=False).returncode
            if rc != 0:
                print(f"level {level}: the benchmark failed (exit {rc})", file=sys.stderr)
                return rc
            data = json.loads(out.read_text())
            got = data["meta"]["ort_kvlayout"].get("build_cpu_isa")
            if got != level:
                print(f"level {level}: the child ran at {got!r}", file=sys.stderr)
                return 1
            per_level[level], metas[level] = data["results"], data["meta"]
    print("\n## per level (throughput medians; ratios to ORT measured in the same process)\n")
    print(level_table(per_level, keys))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(json_path, "w") as f:
            levels_json = {lv: {"meta": metas[lv], "results": per_level[lv]} for lv in levels}
            json.dump({"levels": levels_json}, f, indent=2)
        print(f"JSON: {os.path.relpath(json_path)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="issue",
        help="default shape set (default: issue)",
    )
    p.add_argument("--heads", help="N/Nkv/H list, e.g. 32/8/128,9/3/64 (overrides the preset)")
    p.add_argument("--decode", help="decode cases BxL, e.g. 1x4096,4x4096; '' for none")
    p.add_argument("--prefill", help="prefill cases S or BxS, e.g. 512,2048; '' for none")
    p.add_argument(
        "--kv-mode",
        choices=["dynamic", "shared"],
        default="dynamic",
        help="decode cache: dynamic = separate past (L-1 rows) and present (L rows); "
        "shared = one L-row buffer bound as past and present (default: dynamic)",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="subset of ort,kv0,kv1,kv1plain (default: ort,kv0,kv1, plus kv1plain with --kv-quant)",
    )
    p.add_argument(
        "--kv-quant",
        choices=sorted(KV_QUANT),
        default="none",
        help="quantized cache of every variant but kv1plain (default: none)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads (default 0: ORT's default, all cores)",
    )
    p.add_argument(
        "--per-session-threads",
        action="store_true",
        help="one ORT thread pool per session instead of one global pool shared by "
        "all variants (default: global pool, so idle pools never spin against the "
        "measured one)",
    )
    p.add_argument("--min-reps", type=int, default=10, help="at least this many timed calls")
    p.add_argument(
        "--min-time",
        type=float,
        default=2.0,
        help="and at least this many seconds of timed calls per variant (default 2)",
    )
    p.add_argument("--max-reps", type=int, default=20000, help="cap on timed calls per variant")
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per variant")
    p.add_argument("--seed", type=int, default=20240, help="numpy seed for the inputs")
    p.add_argument(
        "--isa",
        default="all",
        help="CPU kernel levels to measure, each in a child process: 'all' (default: every "
        "level this CPU supports), a list such as portable,avx2, or 'current' (this process's "
        f"level only, as {ISA_ENV} or the CPU decides)",
    )
    p.add_argument(
        "--json",
        default=None,
        help="JSON output path (default: bench/results/cpu-<date>.json; '' for none)",
    )
    args = p.parse_args(argv)

    if args.variants is None:
        plain = ("kv1plain",) if args.kv_quant != "none" else ()
        args.variants = ",".join(DEFAULT_VARIANTS + plain)
    keys = [k.strip() for k in args.variants.split(",") if k.strip()]
    if not keys or any(k not in VARIANTS for k in keys):
        p.error(f"--variants: choose from {','.join(VARIANTS)}")
    cases = build_cases(args)
    if not cases:
        p.error("no cases")

    argv_used = sys.argv[1:] if argv is None else argv
    script = os.path.relpath(Path(__file__).resolve(), Path.cwd())
    command = " ".join(["python", shlex.quote(script)] + [shlex.quote(a) for a in argv_used])
    now = _dt.datetime.now(_dt.timezone.utc).astimezone()
    default_json = str(REPO / "bench" / "results" / f"cpu-{now.strftime('%Y-%m-%d')}.json")

    if args.isa != "current":
        supported = supported_levels()
        levels = supported if args.isa == "all" else [x.strip() for x in args.isa.split(",")]
        for lv in levels:
            if lv not in supported:
                p.error(f"--isa {lv}: this library and CPU support {','.join(supported)}")
        child_argv = []  # the arguments without --isa and --json: the parent owns those
        skip = False
        for a in argv_used:
            if skip:
                skip = False
            elif a in ("--isa", "--json"):
                skip = True
            elif not a.startswith(("--isa=", "--json=")):
                child_argv.append(a)
        return run_levels(
            levels, child_argv, keys, default_json if args.json is None else args.json
        )

    if not args.per_session_threads:
        # Must come before the first session (the ORT environment is created then).
        ort.capi._pybind_state.set_global_thread_pool_sizes(args.threads, 1)

    def so_factory(domain: str) -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if args.per_session_threads:
            so.intra_op_num_threads = args.threads
            so.inter_op_num_threads = 1
        else:
            so.use_per_session_threads = False
        if domain == KV_DOMAIN:
            ort_kvlayout.register(so)
        return so

    meta = {
        "date": now.isoformat(timespec="seconds"),
        "command": command,
        "machine": machine_info(),
        "onnxruntime": ort.__version__,
        "ort_kvlayout": library_info(),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "threads": args.threads or "ORT default (all cores)",
        "thread_pool": "per session" if args.per_session_threads else "global (shared)",
        "kv_mode": args.kv_mode,
        "seed": args.seed,
        "dtype": "float32",
        "kv_quant": args.kv_quant,
        "loadavg_start": os.getloadavg(),
        "min_reps": args.min_reps,
        "min_time_s": args.min_time,
        "order": "round-robin over variants per repetition, starting variant rotated",
        "metrics": {
            "decode": "GB/s of KV read = 2*B*Nkv*L*H*(bytes an element as stored: 4 float32, "
            "1 int8, 0.5 int4) / median time",
            "prefill": "GFLOP/s, causal flops = 4*B*N*H*S*(S+1)/2 / median time",
        },
    }
    m = meta["machine"]
    print(f"# CPU GroupQueryAttention benchmark ({meta['date']})")
    print(f"command: {command}")
    print(
        f"machine: {m.get('model_name')}, {m.get('physical_cores')} cores, "
        f"{m.get('logical_cpus')} logical CPUs; load avg {meta['loadavg_start']}"
    )
    lib = meta["ort_kvlayout"]
    print(
        f"CPU kernel level {lib.get('build_cpu_isa')} (built {lib.get('build_cpu_isas')}, "
        f"best supported {lib.get('build_cpu_isa_best')}); ISA flags {m.get('isa_flags')}"
    )
    print(
        f"onnxruntime {meta['onnxruntime']}, ort_kvlayout {meta['ort_kvlayout']['version']} "
        f"(git {meta['ort_kvlayout'].get('git', '?')}); threads: {meta['threads']}, "
        f"{meta['thread_pool']} pool; seed {args.seed}; fp32; decode cache {args.kv_mode}"
    )
    sys.stdout.flush()

    rng = np.random.default_rng(args.seed)
    results = []
    for case in cases:
        feeds = make_inputs(case, rng)
        shared_inputs: dict = {}
        variants = {k: Variant(k, case, feeds, so_factory, shared_inputs) for k in keys}
        snap = cpu_snapshot()
        times = measure(variants, args)
        foreign = other_load(snap, cpu_snapshot())
        diffs = check_agreement(variants, case)
        # kv1plain reads the float32 cache: its GB/s counts those bytes.
        plain = dataclasses.replace(case, quant="none")
        stats = {k: summarize(case if variants[k].quantized else plain, times[k]) for k in keys}
        ratio = {}
        if "ort" in keys:
            ratio = {
                k: stats[k]["throughput"] / stats["ort"]["throughput"] for k in keys if k != "ort"
            }
        res = {
            "case": {
                **case.__dict__,
                "name": case.name,
                "heads": case.heads,
                "present_len": case.present_len,
                "work_per_call": case.work(),
            },
            "stats": stats,
            "ratio": ratio,
            "max_abs_diff": diffs,
            "loadavg_after": os.getloadavg(),
            "other_processes_cpus": foreign,
        }
        results.append(res)
        summary = "  ".join(f"{k} {stats[k]['throughput']:.1f} {case.unit}" for k in keys)
        ratios = "  ".join(f"{k}/ort {v:.2f}" for k, v in ratio.items())
        print(
            f"{case.name:<24} {case.heads:<9} {summary}  {ratios}  ({stats[keys[0]]['reps']} reps)",
            file=sys.stderr,
        )
        del variants, feeds, shared_inputs

    meta["loadavg_end"] = os.getloadavg()
    print()
    print(markdown_table(results, keys))
    print()
    print(
        "Throughput: median [p10, p90] over the timed calls. Decode: GB/s of KV read "
        "(2*B*Nkv*L*H*4 bytes per call; S=1, total L, non-shared past of L-1 rows unless "
        "--kv-mode shared). Prefill: GFLOP/s with causal flops 4*B*N*H*S*(S+1)/2 "
        "(first prompt, no past). ms: median per call. other load: CPUs' worth of work done by "
        "other processes during the case (from /proc/stat; 0 = idle machine)."
    )
    print(f"load avg start {meta['loadavg_start']}, end {meta['loadavg_end']}")

    json_path = default_json if args.json is None else args.json
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        print(f"JSON: {os.path.relpath(json_path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
