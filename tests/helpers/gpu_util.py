"""Helpers of the GPU tests (tests/op/test_gqa_cuda.py, tests/op/test_cuda_graph.py).

* ``SKIP_REASON``: None when onnxruntime offers CUDAExecutionProvider and ort_kvlayout was built
  with CUDA (``cuda_available()``); else why the GPU tests skip (``GPU_MARKS``, a module's marks).
* ``cuda_session``: a session on the CUDA EP with CPU fallback disabled, so a node that would
  silently run on the CPU makes session creation fail instead of passing a GPU test on the CPU.
* ``run_cuda``: one run through IO binding with every input on the device (OrtValues on
  'cuda'), total_sequence_length in CPU memory (as onnxruntime-genai binds it), preallocated
  NaN-filled outputs (a defined element the op forgot to write shows as NaN), and past/present
  bound to one OrtValue when ``shared``.
* ``to_device`` / ``from_device``: numpy <-> CUDA OrtValue for float32 / float16 / bfloat16 /
  int (bf16 goes in through a uint16 view and comes back through a Cast-to-float32 session,
  since ORT's numpy bridge has no bfloat16).
* ``assert_close``: per tensor, over the rows the contract defines, with max errors in the
  message.
* ``BASE_SEED``: from $GQA_GPU_SEED, else fresh per process; every failure message says how to
  reproduce (GQA_GPU_SEED=...).

Harness self-test without a GPU: GQA_GPU_EMULATE_CPU=1 runs the same tests with the CPU EP and
CPU OrtValues against the CPU op (no CUDA graph, no fallback check); it checks the tests, not
the CUDA op.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import OrderedDict

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
import reference as ref
from gqa_case import KV_DOMAIN, MS_DOMAIN, GqaCase, as_f64, build_model
from onnx import TensorProto, helper

CUDA_EP = "CUDAExecutionProvider"
BF16 = np.dtype(ml_dtypes.bfloat16)
HERE = os.path.dirname(os.path.abspath(__file__))

# Fresh data each process unless pinned; the structure of every grid is fixed (stable test ids).
BASE_SEED = int(os.environ.get("GQA_GPU_SEED") or (time.time_ns() // 1000) % 1_000_000_007)
# Smaller grids (the compute-sanitizer passes of scripts/run_gpu_tests.sh set it).
QUICK = os.environ.get("GQA_GPU_QUICK", "") not in ("", "0")
EMULATE = os.environ.get("GQA_GPU_EMULATE_CPU", "") not in ("", "0")
DEVICE = "cpu" if EMULATE else "cuda"


def seed_note() -> str:
    return f"[reproduce: GQA_GPU_SEED={BASE_SEED}]"


def case_seed(i: int) -> int:
    return (BASE_SEED + 7919 * i) % (2**31 - 1)


def _skip_reason() -> str | None:
    if EMULATE:
        from gqa_case import op_available

        ok, why = op_available()
        return None if ok else f"(emulated on CPU) ort_kvlayout not usable: {why}"
    try:
        providers = ort.get_available_providers()
    except Exception as e:  # noqa: BLE001
        return f"onnxruntime.get_available_providers() failed: {e}"
    if CUDA_EP not in providers:
        return (
            f"onnxruntime {ort.__version__} ({os.path.dirname(ort.__file__)}) has no "
            f"{CUDA_EP} (providers: {providers}); install onnxruntime-gpu"
        )
    try:
        import ort_kvlayout
    except Exception as e:  # noqa: BLE001
        return f"cannot import ort_kvlayout: {type(e).__name__}: {e}"
    try:
        ok = ort_kvlayout.cuda_available()
    except Exception as e:  # noqa: BLE001
        return f"ort_kvlayout.cuda_available() raised {type(e).__name__}: {e}"
    if not ok:
        try:
            info = ort_kvlayout.build_info()
        except Exception as e:  # noqa: BLE001
            info = f"build_info() raised {e}"
        return f"ort_kvlayout.cuda_available() is False (build_info: {info})"
    return None


SKIP_REASON = _skip_reason()
# The marks of a GPU test module (pytestmark): "gpu", and a skip without the CUDA EP and op.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(SKIP_REASON is not None, reason=f"GPU tests: {SKIP_REASON}"),
]


# --------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------
class NotOnCuda(Exception):
    """Session creation failed because a node would have run on the CPU EP."""


def session_options(domain: str) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Every node must run on the CUDA EP: a GQA node that fell back to the CPU would pass the
    # numerical checks while testing nothing of the CUDA op.
    if not EMULATE:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if domain == KV_DOMAIN:
        import ort_kvlayout

        ort_kvlayout.register(so)
    return so


def cuda_providers(graph: bool = False):
    if EMULATE:
        return ["CPUExecutionProvider"]
    opts = {"device_id": "0"}
    if graph:
        opts["enable_cuda_graph"] = "1"
    # No CPU EP in the list: ORT refuses it together with disable_cpu_ep_fallback.
    return [(CUDA_EP, opts)]


def new_cuda_session(model: bytes, domain: str, graph: bool = False) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(model, session_options(domain), providers=cuda_providers(graph))
    except Exception as e:
        if "fallback" in str(e) and "CPU" in str(e):
            raise NotOnCuda(
                f"the {domain} GroupQueryAttention node was not placed on {CUDA_EP} (no CUDA "
                f"kernel for these input types?): {str(e)[-400:]}"
            ) from e
        raise


_SESSIONS: OrderedDict = OrderedDict()


def cuda_session(model: bytes, domain: str) -> ort.InferenceSession:
    """A cached CUDA session per model (the models' shapes are symbolic, so many cases share
    one; sessions are costly to create on the CUDA EP)."""
    key = (domain, model)
    sess = _SESSIONS.get(key)
    if sess is None:
        sess = new_cuda_session(model, domain)
        _SESSIONS[key] = sess
        while len(_SESSIONS) > 64:
            _SESSIONS.popitem(last=False)
    else:
        _SESSIONS.move_to_end(key)
    return sess


# --------------------------------------------------------------------------------------------
# Device values
# --------------------------------------------------------------------------------------------
_ONNX_TYPE = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    BF16: TensorProto.BFLOAT16,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int8): TensorProto.INT8,  # quantized caches: int8 codes, packed int4 in uint8
    np.dtype(np.uint8): TensorProto.UINT8,
}


def _host_bits(arr: np.ndarray) -> np.ndarray:
    """A numpy array ORT's bridge accepts, with ``arr``'s bytes (bf16 as uint16)."""
    arr = np.ascontiguousarray(arr)
    return arr.view(np.uint16) if arr.dtype == BF16 else arr


def device_empty(shape, dtype) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_shape_and_type(
        [int(s) for s in shape], _ONNX_TYPE[np.dtype(dtype)], DEVICE, 0
    )


def to_device(arr) -> ort.OrtValue:
    arr = np.asarray(arr)
    ov = device_empty(arr.shape, arr.dtype)
    if arr.size:
        ov.update_inplace(_host_bits(arr))
    return ov


def to_device_as(arr, onnx_type: int) -> ort.OrtValue:
    """``arr``'s bytes as a device tensor of ONNX element type ``onnx_type`` (a float8e4m3fn
    cache held in uint8 on the host; ``from_device`` reads it back as uint8)."""
    arr = np.ascontiguousarray(np.asarray(arr))
    ov = ort.OrtValue.ortvalue_from_shape_and_type(
        [int(s) for s in arr.shape], onnx_type, DEVICE, 0
    )
    if arr.size:
        ov.update_inplace(arr)
    return ov


def update(ov: ort.OrtValue, arr) -> None:
    """Copies ``arr`` into the device OrtValue (same address: what CUDA graph replay needs)."""
    ov.update_inplace(_host_bits(np.asarray(arr)))


def device_filled(shape, dtype, value=np.nan) -> ort.OrtValue:
    return to_device(np.full(shape, value, dtype=np.dtype(dtype)))


_CAST_SESSION = None


def _cast_session():
    global _CAST_SESSION
    if _CAST_SESSION is None:
        x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, None)
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
        node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)
        g = helper.make_graph([node], "readback", [x], [y])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        _CAST_SESSION = ort.InferenceSession(m.SerializeToString(), so, providers=cuda_providers())
    return _CAST_SESSION


def from_device(ov: ort.OrtValue, dtype=None) -> np.ndarray:
    """A host copy of a device OrtValue (bf16 exactly, through float32)."""
    if ov.data_type() == "tensor(bfloat16)":
        if int(np.prod(ov.shape())) == 0:
            return np.zeros(ov.shape(), BF16)
        sess = _cast_session()
        io = sess.io_binding()
        io.bind_ortvalue_input("x", ov)
        io.bind_output("y", "cpu")
        sess.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()[0].astype(BF16)
    return np.array(ov.numpy(), copy=True)


# --------------------------------------------------------------------------------------------
# Running one GQA call on the CUDA EP
# --------------------------------------------------------------------------------------------
def output_shapes(feeds: dict, attrs: dict):
    inputs = {k: v for k, v in feeds.items() if v is not None}
    plan = ref.plan_step(inputs, attrs)
    out = (plan.batch, plan.seq, plan.num_heads * plan.head_size)
    pres = (plan.batch, plan.kv_heads, plan.present_capacity, plan.head_size)
    return out, pres


def bind_inputs(sess, io, feeds: dict):
    """Binds the session's inputs among ``feeds``: (host arrays by name, device OrtValues by
    name; keep the latter alive until the run)."""
    names = {i.name for i in sess.get_inputs()}
    inputs = {k: np.asarray(v) for k, v in feeds.items() if v is not None and k in names}
    dev = {}
    for k, v in inputs.items():
        if k == "total_sequence_length":  # a CPU input of the op, bound in CPU memory
            io.bind_cpu_input(k, np.ascontiguousarray(v))
        else:
            dev[k] = to_device(v)
            io.bind_ortvalue_input(k, dev[k])
    return inputs, dev


def bind_and_run(sess, feeds: dict, attrs: dict, shared: bool = False):
    """Binds and runs once; returns the device OrtValues (output, present_key, present_value)
    and the binding's input OrtValues (name -> OrtValue)."""
    io = sess.io_binding()
    inputs, dev = bind_inputs(sess, io, feeds)
    try:
        out_shape, pres_shape = output_shapes(inputs, attrs)
    except Exception:  # noqa: BLE001 - invalid inputs (error tests): let ORT allocate outputs
        for name in ("output", "present_key", "present_value"):
            io.bind_output(name, DEVICE)
        sess.run_with_iobinding(io)
        return tuple(io.get_outputs()), dev
    qdt = inputs["query"].dtype
    kvdt = inputs["past_key"].dtype if "past_key" in inputs else qdt
    out = device_filled(out_shape, qdt)
    io.bind_ortvalue_output("output", out)
    if shared:
        pk, pv = dev["past_key"], dev["past_value"]
    else:
        pk, pv = device_filled(pres_shape, kvdt), device_filled(pres_shape, kvdt)
    io.bind_ortvalue_output("present_key", pk)
    io.bind_ortvalue_output("present_value", pv)
    sess.run_with_iobinding(io)
    return (out, pk, pv), dev


def run_cuda(sess, feeds: dict, attrs: dict, shared: bool = False):
    """(output, present_key, present_value) as host arrays, after one run on the CUDA EP."""
    (out, pk, pv), _ = bind_and_run(sess, feeds, attrs, shared)
    return from_device(out), from_device(pk), from_device(pv)


def run_case_cuda(case: GqaCase, domain: str = KV_DOMAIN, feeds=None, attrs=None):
    feeds = case.feeds() if feeds is None else feeds
    attrs = case.attrs() if attrs is None else attrs
    lay = case.kv_layout if domain == KV_DOMAIN else None
    if domain == MS_DOMAIN:
        assert case.kv_layout == 0, "com.microsoft GQA is head-major only"
    sess = cuda_session(build_model(feeds, attrs, domain, lay), domain)
    return run_cuda(sess, feeds, attrs, case.shared)


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------
# (output atol, output rtol, present atol, present rtol) against the float64 oracle fed the same
# low-precision inputs.  Output: fp32 accumulation, P rounded to the storage type before P@V
# (~2^-11 / 2^-8 relative) and one rounding of the result; presents: copies, or rotary computed
# in fp32 and rounded once (half an ulp; 2 ulps allowed).  fp32 keeps the CPU contract's 2e-4
# (a TF32 path would fail it, on purpose: fp32 means fp32).
GPU_TOLS = {
    "fp32": (2e-4, 2e-4, 2e-5, 2e-5),
    "fp16": (3e-3, 3e-3, 1e-3, 2.0**-9),
    "bf16": (2e-2, 2e-2, 8e-3, 2.0**-6),
}
NAMES = ("output", "present_key", "present_value")


def dtype_name(arr) -> str:
    dt = np.asarray(arr).dtype
    return {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16", BF16: "bf16"}[dt]


def assert_close(got, want, masks, dtype: str, what: str = "", scale: float = 1.0):
    """got / want: (output, present_key, present_value), presents in the same byte order as
    ``masks`` (from reference.defined_masks).  Returns the max abs errors."""
    rows, pmask = masks
    oa, orr, ka, kr = GPU_TOLS[dtype]
    errs = []
    for name, g, w in zip(NAMES, got, want, strict=True):
        g, w = as_f64(g), as_f64(w)
        assert g.shape == w.shape, f"{what}{name}: shape {g.shape}, expected {w.shape}"
        if name == "output":
            sel, atol, rtol = np.broadcast_to(rows[:, :, None], g.shape), oa, orr
        else:
            sel, atol, rtol = pmask, ka, kr
        atol, rtol = atol * scale, rtol * scale
        gs, ws = g[sel], w[sel]
        if gs.size == 0:
            errs.append(0.0)
            continue
        err = np.abs(gs - ws)
        bad = ~(err <= atol + rtol * np.abs(ws))  # NaN / inf count as bad
        e = float(np.nanmax(err)) if np.isfinite(err).any() else float("inf")
        errs.append(e)
        if bad.any():
            idx = np.argwhere(sel)[np.flatnonzero(bad)[:4]]
            samples = [(i, float(g[tuple(i)]), float(w[tuple(i)])) for i in idx.tolist()]
            raise AssertionError(
                f"{what}{name}: {int(bad.sum())}/{gs.size} defined elements off "
                f"(max err {e:.3g}, tolerance {atol:.2g} + {rtol:.2g}*|want|, non-finite "
                f"{int((~np.isfinite(gs)).sum())}); first (index, got, want): {samples} "
                f"{seed_note()}"
            )
    return errs


def hm(arr, layout: int):
    """A present in ``layout`` byte order -> the same logical content in layout 0 (float64)."""
    return ref.to_layout(ref.from_layout(as_f64(arr), layout), 0)


# --------------------------------------------------------------------------------------------
# Out-of-range lengths in a child process (a crash must not take pytest down)
# --------------------------------------------------------------------------------------------
GUARD = {np.dtype(np.float16): np.float16(-1234.0)}


def _guarded_buffer(logical_bnsh: np.ndarray, layout: int, guard_elems: int):
    """A device buffer [guard | cache in ``layout`` order | guard]; returns (OrtValue, host copy,
    element offset of the cache)."""
    body = ref.to_layout(logical_bnsh, layout).reshape(-1)
    g = np.full(guard_elems, GUARD[body.dtype], body.dtype)
    host = np.concatenate([g, body, g])
    return to_device(host), host, guard_elems


def robustness_child(spec: dict) -> list[dict]:
    """Runs each scenario of ``spec`` on one shared, guarded fp16 cache: first with the
    out-of-range values, then (same buffers, restored content) with valid ones.  Returns one
    record per scenario; never raises for the invalid run (the op may raise or not)."""
    layout = spec["layout"]
    results = []
    for sc in spec["scenarios"]:
        print("START", json.dumps(sc), flush=True)
        results.append(_robust_one(layout, sc))
        print("RESULT", json.dumps(results[-1]), flush=True)
    return results


def _robust_one(layout: int, sc: dict) -> dict:
    kind = sc["kind"]
    batch = sc.get("batch", 2)
    case = GqaCase(
        batch=batch,
        seq={"prompt": 7, "decode": 1, "chunk": 4}[kind],
        kind=kind,
        past_len=0 if kind == "prompt" else 11,
        pad=3 if batch > 1 else 0,
        num_heads=4,
        kv_num_heads=2,
        head_size=64,
        dtype="fp16",
        kv_layout=layout,
        shared=True,
        extra_capacity=5,
        do_rotary=True,
        position_ids=sc.get("position_ids", False),
        query_seqlens=sc.get("query_seqlens", False),
        seed=sc["seed"],
    )
    attrs = case.attrs()
    good = case.feeds()
    bad = dict(good)
    for name, vals in sc["bad"].items():
        bad[name] = np.array(vals, dtype=np.asarray(good[name]).dtype).reshape(good[name].shape)
    B, Nkv, C, H = good["past_key"].shape
    logical_k = ref.from_layout(good["past_key"], layout)
    logical_v = ref.from_layout(good["past_value"], layout)
    guard = max(4096, Nkv * C * H)
    kbuf, khost, off = _guarded_buffer(logical_k, layout, guard)
    vbuf, vhost, _ = _guarded_buffer(logical_v, layout, guard)
    n = B * Nkv * C * H
    try:
        sess = new_cuda_session(build_model(good, attrs, KV_DOMAIN, layout), KV_DOMAIN)
    except Exception as e:  # noqa: BLE001
        return {"scenario": sc, "setup_error": f"{type(e).__name__}: {str(e)[-300:]}"}

    def guards_intact(kh, vh) -> bool:
        """The guard regions before and after the cache in both buffers are as written."""
        return all(
            np.array_equal(now[:off], host[:off])
            and np.array_equal(now[off + n :], host[off + n :])
            for now, host in ((kh, khost), (vh, vhost))
        )

    def run(feeds):
        io = sess.io_binding()
        others = {k: v for k, v in feeds.items() if k not in ("past_key", "past_value")}
        _, _on_device = bind_inputs(sess, io, others)  # past: the guarded buffers, below
        shape = [B, Nkv, C, H]
        pairs = (("past_key", "present_key", kbuf), ("past_value", "present_value", vbuf))
        for past, pres, buf in pairs:
            ptr = buf.data_ptr() + off * 2
            io.bind_input(past, DEVICE, 0, np.float16, shape, ptr)
            io.bind_output(pres, DEVICE, 0, np.float16, shape, ptr)
        out_shape, _ = output_shapes(feeds, attrs)
        out = device_filled(out_shape, np.float16)
        io.bind_ortvalue_output("output", out)
        sess.run_with_iobinding(io)
        return from_device(out)

    rec: dict = {"scenario": sc}
    try:
        run(bad)
        rec["invalid_run"] = "ran"
    except Exception as e:  # noqa: BLE001 - raising is allowed; crashing is not
        rec["invalid_run"] = f"raised: {str(e).split('Status Message:')[-1].strip()[:200]}"
    kh, vh = from_device(kbuf), from_device(vbuf)
    # The device-side record of the invalid run (CONTRACT 2a), taken so the valid run below is
    # not failed by it.
    import ort_kvlayout

    rec["recorded"] = ort_kvlayout.take_length_error()
    rec["guard_ok"] = guards_intact(kh, vh)
    # Batch entries whose lengths were valid keep their cached rows (only decode / chunk: a
    # first prompt rewrites rows [0, T_b)).
    P = case.lengths()[0]
    other = []
    bad_entries = set(sc.get("bad_entries", [0]))
    if kind != "prompt":
        for which, hbuf, lg in (("key", kh, logical_k), ("value", vh, logical_v)):
            now = ref.from_layout(hbuf[off : off + n].reshape(B, Nkv, C, H), layout)
            for b in range(B):
                if b not in bad_entries and not np.array_equal(now[b, :, : P[b]], lg[b, :, : P[b]]):
                    other.append(f"{which}[{b}]")
    rec["valid_entries_untouched"] = not other
    rec["clobbered"] = other
    # The next valid run on restored buffers must be right.
    update(kbuf, khost)
    update(vbuf, vhost)
    try:
        out = run(good)
    except Exception as e:  # noqa: BLE001 - e.g. a refused feature; reported to the parent
        rec["valid_after"] = f"raised: {str(e).split('Status Message:')[-1].strip()[:300]}"
        out = None
    kh, vh = from_device(kbuf), from_device(vbuf)
    if out is not None:
        got = (
            out,
            kh[off : off + n].reshape(B, Nkv, C, H),
            vh[off : off + n].reshape(B, Nkv, C, H),
        )
        try:
            errs = assert_close(got, case.reference(), case.masks(), "fp16", "valid run: ")
            rec["valid_after"] = "ok, max errs " + ", ".join(f"{e:.2g}" for e in errs)
        except AssertionError as e:
            rec["valid_after"] = f"WRONG: {str(e)[:600]}"
    rec["guard_ok_after_valid"] = guards_intact(kh, vh)
    return rec


def decode_kernels_child(specs: list[dict]) -> None:
    """For each GqaCase (its fields as a dict), one run on the CUDA EP, then one under torch's
    profiler; prints "RESULT " and a JSON object: the device's SM count ("sms"), its shared
    memory per block ("smem_optin", bytes) and the names of the device kernels of that run that
    name a decode kernel ("kernels", one per launch; ours is DecodeTcKernel<T, HD, form, W>).
    Prints "SKIP " and why, and nothing else, where torch has no CUDA. In a child: torch's CUDA
    libraries stay out of the suite's process."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        print("SKIP torch without CUDA (a CPU-only build)", flush=True)
        return
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    # Not in every torch: then the opt-in limit of the compute capability (sm_80 163 KB, sm_90
    # 227 KB, others 99 KB).
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if smem is None:
        smem = {(8, 0): 163, (9, 0): 227}.get((props.major, props.minor), 99) * 1024
    for spec in specs:
        case = GqaCase(**spec)
        feeds, attrs = case.feeds(), case.attrs()
        sess = cuda_session(build_model(feeds, attrs, KV_DOMAIN, case.kv_layout), KV_DOMAIN)
        bind_and_run(sess, feeds, attrs, case.shared)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            bind_and_run(sess, feeds, attrs, case.shared)
            torch.cuda.synchronize()
        names = sorted(
            e.name for e in prof.events() if e.device_type.name == "CUDA" and "Decode" in e.name
        )
        print(
            "RESULT " + json.dumps({"sms": sms, "smem_optin": smem, "kernels": names}), flush=True
        )


def _run_child(function: str, arg, timeout: float, env: dict):
    """Runs ``gpu_util.<function>(arg)`` (arg through JSON) in a fresh interpreter with `env` and
    this process's data seed; returns the CompletedProcess (text) and the records it printed as
    "RESULT <json>" lines. subprocess.TimeoutExpired passes through."""
    import subprocess

    code = (
        f"import sys, json; sys.path.insert(0, {HERE!r})\n"
        "import gpu_util\n"
        f"gpu_util.{function}(json.loads({json.dumps(arg)!r}))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
        check=False, env=dict(env, GQA_GPU_SEED=str(BASE_SEED)),
    )  # fmt: skip
    recs = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    return p, recs


def run_decode_kernels_child(
    specs: list[dict], timeout: float = 600.0, knobs: dict[str, str] | None = None
):
    """Runs ``decode_kernels_child(specs)`` in a fresh interpreter, without the plan's knobs
    (ORT_KVLAYOUT_DECODE_*) in its environment but `knobs`; returns (returncode, one record per
    spec, stdout + stderr), the returncode None where the child ran past `timeout`."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("ORT_KVLAYOUT_DECODE_")}
    env.update(knobs or {})
    try:
        p, recs = _run_child("decode_kernels_child", specs, timeout, env)
    except subprocess.TimeoutExpired as e:
        out = b"".join(x or b"" for x in (e.stdout, e.stderr))  # bytes, whatever text= says
        return None, [], f"ran past {timeout} s\n{out.decode(errors='replace')}"
    return p.returncode, recs, p.stdout + p.stderr


def run_robustness_child(spec: dict, timeout: float = 900.0):
    """Runs ``robustness_child(spec)`` in a fresh interpreter; returns (returncode, records,
    stdout, stderr)."""
    p, recs = _run_child("robustness_child", spec, timeout, dict(os.environ))
    return p.returncode, recs, p.stdout, p.stderr
