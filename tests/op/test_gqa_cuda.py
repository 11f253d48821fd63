"""ai.kvlayout::GroupQueryAttention on the CUDA EP: against the float64 oracle, against ORT's
built-in com.microsoft GroupQueryAttention on the CUDA EP, layout 0 vs layout 1, shared vs
unshared KV, a prompt + decode + chunk loop kept on the device, invalid inputs (errors that name
the input), and out-of-range device-side lengths (no crash, no write outside the cache, next run
right; in a child process).

Skips without CUDAExecutionProvider or without a CUDA build of ort_kvlayout.  Input data are
fresh per process (seeded from $GQA_GPU_SEED or the clock; failures print the seed); the case
structure is fixed, so test ids are stable.  GQA_GPU_QUICK=1 keeps a small subset (the
compute-sanitizer passes of scripts/run_gpu_tests.sh).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import reference as ref
from gpu_util import (
    BASE_SEED,
    DEVICE,
    EMULATE,
    GPU_MARKS,
    GPU_TOLS,
    QUICK,
    NotOnCuda,
    assert_close,
    bind_inputs,
    case_seed,
    cuda_session,
    device_filled,
    from_device,
    hm,
    output_shapes,
    run_case_cuda,
    run_cuda,
    run_decode_kernels_child,
    run_robustness_child,
    seed_note,
    to_device,
)
from gqa_case import (
    KV_DOMAIN,
    MS_DOMAIN,
    GqaCase,
    as_f64,
    build_model,
    grid_cases,
    head_major_twin,
    refusal,
    rotary_caches,
)

pytestmark = GPU_MARKS


def _label(c: GqaCase) -> str:
    """A stable test id (no seed)."""
    parts = [c.dtype, f"L{c.kv_layout}", c.kind, f"B{c.batch}", f"S{c.seq}", f"P{c.past_len}"]
    parts.append(f"{c.num_heads}x{c.kv_num_heads}x{c.head_size}")
    flags = {
        "pad": c.pad,
        "packed": c.packed,
        "shared": c.shared,
        "extra": c.extra_capacity,
        "rot": c.do_rotary,
        "inter": c.rotary_interleaved,
        "rd": c.rotary_dim,
        "pos": c.position_ids,
        "scale": c.scale,
        "softcap": c.softcap,
        "win": c.local_window_size if c.local_window_size != -1 else 0,
        "smooth": c.smooth_softmax if c.smooth_softmax != -1 else 0,
        "sink": c.head_sink,
        "bias": c.attention_bias,
        "qsl": c.query_seqlens,
        "swc": c.sliding_window_cache,
        "qknorm": c.qk_norm,
    }
    for k, v in flags.items():
        if v is True:
            parts.append(k)
        elif v not in (False, 0, 0.0, ""):
            parts.append(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}")
    return "-".join(parts)


def ours(case: GqaCase):
    """Our op on CUDA; a refusal the contract allows (naming the feature) skips, visibly.
    sliding_window_cache is implemented on CUDA: refusing it fails."""
    try:
        return run_case_cuda(case, KV_DOMAIN)
    except NotOnCuda:
        raise
    except Exception as e:
        allowed = [f for f in case.refusable_features() if f != "sliding_window_cache"]
        r = refusal(allowed, e)
        if r is None:
            raise AssertionError(f"ai.kvlayout on CUDA failed for {case!r}: {e}") from e
        pytest.skip(f"CUDA op refuses (allowed): {r}")


def check_oracle(case: GqaCase, got, what: str = ""):
    return assert_close(got, case.reference(), case.masks(), case.dtype, f"{what}{case!r}: ")


# --------------------------------------------------------------------------------------------
# The core grid: layouts x dtypes x head configurations x lengths
# --------------------------------------------------------------------------------------------
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1), "gqa6": (6, 3)}
# (kind, S, past).  Odd lengths: past 0 / 1 / 37 / 300 (many splits), S 1 / 5 / 17 / 130
# (beyond a 128-row tile); "decode" with past 0 is S == total, i.e. a first prompt of one row.
STEPS = [
    ("prompt", 1, 0),
    ("prompt", 5, 0),
    ("prompt", 17, 0),
    ("prompt", 130, 0),
    ("decode", 1, 0),
    ("decode", 1, 1),
    ("decode", 1, 37),
    ("decode", 1, 300),
    ("chunk", 5, 1),
    ("chunk", 17, 37),
    ("chunk", 5, 200),
]
HEAD_SIZES = (64, 128, 64, 128, 32, 96, 256)


def _core_fields(i, kind, seq, past_len, **_):
    h = HEAD_SIZES[(i * 5) % len(HEAD_SIZES)]
    if h == 256 and (seq > 17 or past_len > 37):
        h = 128  # keeps the oracle fast
    rot = i % 3 != 0
    # Chunked prefill with B > 1 needs query_seqlens (ORT's rule): every 4th chunk case.
    qsl = kind == "chunk" and i % 4 == 1
    batch = (1 + i % 3) if kind != "chunk" else (3 if qsl else 1)
    pad = 0
    if batch > 1 and kind == "prompt" and seq > 1:
        pad = 1 + i % (seq - 1) if seq > 2 else 1
    elif batch > 1 and kind != "prompt" and past_len > 1:
        pad = 1 + i % min(past_len - 1, 9)
    return {
        "batch": batch,
        "head_size": h,
        "pad": pad,
        "extra_capacity": (3 + i % 5) if i % 5 == 0 else 0,
        "do_rotary": rot,
        "rotary_interleaved": bool(i % 5 < 2),
        "rotary_dim": h // 2 if rot and i % 7 == 0 and h >= 32 else 0,
        "position_ids": rot and i % 6 == 1,
        "query_seqlens": qsl,
        "seed": case_seed(i),
    }


CORE = grid_cases(
    {"dtype": ["fp16", "bf16", "fp32"], "layout": [0, 1], "heads": HEADS.values(), "step": STEPS},
    _core_fields,
)
if QUICK:
    CORE = CORE[::19]


@pytest.mark.parametrize("case", CORE, ids=_label)
def test_vs_oracle(case):
    check_oracle(case, ours(case))


# --------------------------------------------------------------------------------------------
# Prefill through cuDNN (first prompts, S >= 64, fp16/bf16, sm_90, no bias/softcap/window/sink):
# the cache read in place through the layout's strides, per-entry lengths on the device. The
# chunked-prefill cases of the grid check that the same shapes with a past go to our kernels.
# --------------------------------------------------------------------------------------------
def _cudnn_grid():
    cases = []
    steps = [  # kind, S, past, batch, pad, query_seqlens
        ("prompt", 64, 0, 1, 0, False),
        ("prompt", 333, 0, 3, 57, False),
        ("chunk", 100, 300, 3, 9, True),
        ("chunk", 200, 37, 1, 0, False),
    ]
    heads = [(8, 2, 128), (12, 4, 64), (4, 1, 256), (6, 3, 96)]
    combos = itertools.product(["fp16", "bf16"], [0, 1], steps, heads)
    for i, (dt, layout, (kind, s, past, batch, pad, qsl), (n, nkv, h)) in enumerate(combos):
        cases.append(
            GqaCase(batch=batch, seq=s, kind=kind, past_len=past, num_heads=n, kv_num_heads=nkv,
                    head_size=h, dtype=dt, kv_layout=layout, pad=pad, query_seqlens=qsl,
                    packed=bool(i % 2), shared=bool((i // 2) % 2), do_rotary=i % 3 != 0,
                    extra_capacity=(5 + i % 7) if i % 4 == 0 else 0, seed=case_seed(60_000 + i))
        )  # fmt: skip
    return cases[::5] if QUICK else cases


@pytest.mark.parametrize("case", _cudnn_grid(), ids=_label)
def test_cudnn_prefill_vs_oracle(case):
    check_oracle(case, ours(case))


def test_cudnn_serves_prefill_where_built():
    """A library built with the cuDNN headers serves prefill through cuDNN on a GPU of compute
    capability 9+ (the count of cuDNN launches grows); the reason is reported otherwise."""
    import ort_kvlayout

    case = GqaCase(kind="prompt", seq=256, batch=2, pad=31, num_heads=8, kv_num_heads=2,
                   head_size=128, dtype="fp16", kv_layout=1, do_rotary=True,
                   seed=case_seed(61_000))  # fmt: skip
    check_oracle(case, ours(case))
    before = ort_kvlayout.cudnn_status()
    assert before is not None, "the CUDA library is loaded: its cuDNN status must be readable"
    if before.startswith("not built"):
        pytest.skip(f"library built without cuDNN: {before}")
    torch = pytest.importorskip("torch", reason="torch tells the compute capability")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN prefill serves sm_90+ only")
    assert before.startswith("cuDNN "), before
    again = case.replace(seed=case_seed(61_001))  # the cached graph, other buffers
    check_oracle(again, ours(again))
    after = ort_kvlayout.cudnn_status()
    launches = [int(x.rsplit(" ", 1)[1]) for x in (before, after)]
    assert launches[1] > launches[0], f"cuDNN did not serve the prefill: {before} -> {after}"


# --------------------------------------------------------------------------------------------
# Features (each in both layouts, fp16 and bf16, in every case kind)
# --------------------------------------------------------------------------------------------
FEATURES = {
    "softcap": {"softcap": 2.5},
    "softcap_bias_scale": {"softcap": 1.5, "attention_bias": "bn", "scale": 0.3},
    "bias_b1": {"attention_bias": "b1"},
    "bias_1n": {"attention_bias": "1n"},
    "bias_11": {"attention_bias": "11"},
    "window1": {"local_window_size": 1},
    "window5": {"local_window_size": 5},
    "window200": {"local_window_size": 200},
    "smooth": {"smooth_softmax": 1},
    "smooth0": {"smooth_softmax": 0},
    "sink": {"head_sink": True},
    "sink_smooth": {"head_sink": True, "smooth_softmax": 1},
    "rotary": {"do_rotary": True},
    "rotary_inter": {"do_rotary": True, "rotary_interleaved": True},
    "rotary_partial": {"do_rotary": True, "rotary_dim": 32},
    "rotary_partial_inter": {"do_rotary": True, "rotary_dim": 32, "rotary_interleaved": True},
    "position_ids": {"do_rotary": True, "position_ids": True},
    "scale": {"scale": 0.05},
    "all": {"do_rotary": True, "softcap": 3.0, "local_window_size": 9, "head_sink": True,
            "attention_bias": "b1"},
    "qk_norm": {"qk_norm": True},
    "swc": {"sliding_window_cache": True, "local_window_size": 8},
}  # fmt: skip
KINDS = {
    "prompt": {"batch": 3, "seq": 12, "kind": "prompt", "pad": 5},
    "decode": {"batch": 3, "seq": 1, "kind": "decode", "past_len": 23, "pad": 7},
    "chunk": {"batch": 1, "seq": 6, "kind": "chunk", "past_len": 23},
    "chunk_qsl": {
        "batch": 3,
        "seq": 6,
        "kind": "chunk",
        "past_len": 23,
        "pad": 4,
        "query_seqlens": True,
    },
    # Long enough for the tensor-core prefill (>= 16 new tokens) and for many key splits.
    "prompt_long": {"batch": 2, "seq": 40, "kind": "prompt", "pad": 9},
    "chunk_long": {"batch": 1, "seq": 24, "kind": "chunk", "past_len": 45},
    "decode_long": {"batch": 2, "seq": 1, "kind": "decode", "past_len": 700, "pad": 260},
}


def _feature_fields(j, kind, sliding_window_cache=False, **_):
    kw = {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "shared": bool(j % 2),
          "packed": bool((j // 3) % 2), "seed": case_seed(10_000 + j)}  # fmt: skip
    if sliding_window_cache and kind == "prompt":
        kw["pad"] = 0  # a right-padded first prompt is refused with sliding_window_cache
    return kw


FEATURE_CASES = grid_cases(
    {"feature": FEATURES, "call": KINDS, "dtype": ["fp16", "bf16"], "layout": [0, 1]},
    _feature_fields,
)
if QUICK:
    FEATURE_CASES = FEATURE_CASES[::23]


@pytest.mark.parametrize("case", FEATURE_CASES, ids=_label)
def test_features_vs_oracle(case):
    check_oracle(case, ours(case))


# --------------------------------------------------------------------------------------------
# Dispatch coverage: every head size the CUDA op takes reaches the tensor-core prefill (tiles
# of 32 columns, the rest zero; a CTA's rows are 64/G tokens x the G heads of a KV group) and the
# tensor-core decode (S x G <= 16 rows of one KV group; larger groups take the portable kernel).
# --------------------------------------------------------------------------------------------
TC_HEAD_SIZES = (8, 16, 24, 40, 80, 96, 112, 160, 192, 224, 256)
GROUPS = ((3, 3), (6, 3), (9, 3), (8, 2), (14, 2), (16, 2), (32, 2))  # G = 1, 2, 3, 4, 7, 8, 16
# 80 and 200: padded tiles (head size below the tile width) with 16-key steps, and with 2 stages.
DECODE_HEAD_SIZES = (8, 40, 64, 80, 96, 128, 200, 256)


def _dispatch_cases():
    out = []
    for i, (h, kind, layout) in enumerate(
        itertools.product(TC_HEAD_SIZES, ["prompt", "chunk"], [0, 1])
    ):
        kw = ({"batch": 2, "seq": 37, "pad": 6} if kind == "prompt"
              else {"batch": 1, "seq": 20, "past_len": 45})  # fmt: skip
        out.append(GqaCase(kind=kind, num_heads=4, kv_num_heads=2, head_size=h,
                           dtype=("fp16", "bf16")[i % 2], kv_layout=layout, shared=bool(i % 3 == 0),
                           do_rotary=h % 16 == 0 and i % 4 < 2, softcap=2.0 if i % 5 == 0 else 0.0,
                           local_window_size=17 if i % 7 == 3 else -1,
                           seed=case_seed(30_000 + i), **kw))  # fmt: skip
    for i, ((n, nkv), h) in enumerate(itertools.product(GROUPS, DECODE_HEAD_SIZES)):
        past = (1, 63, 64, 333, 1100)[i % 5]
        out.append(GqaCase(kind="decode", batch=1 + i % 3, past_len=past, pad=min(past - 1, 5 + i),
                           num_heads=n, kv_num_heads=nkv, head_size=h,
                           dtype=("fp16", "bf16")[i % 2], kv_layout=(i // 2) % 2,
                           shared=bool(i % 3 == 1), extra_capacity=(0, 7, 100)[i % 3],
                           do_rotary=h % 16 == 0 and i % 3 == 0,
                           attention_bias="bn" if i % 4 == 2 else "",
                           head_sink=i % 6 == 5, seed=case_seed(31_000 + i)))  # fmt: skip
    # A few new tokens whose (token, head) rows fit one 16-row tile take the decode kernel too.
    small = itertools.product((2, 3, 5, 8), ((2, 2), (4, 2), (6, 2)), ["prompt", "chunk"])
    for i, (seq, (n, nkv), kind) in enumerate(small):
        h = (64, 40, 128, 256)[i % 4]
        kw = ({"batch": 2, "seq": seq, "pad": min(seq - 1, 1 + i % 2)} if kind == "prompt"
              else {"batch": 1 + i % 2, "seq": seq, "past_len": (45, 300)[i % 2],
                    "query_seqlens": i % 2 == 1})  # fmt: skip
        out.append(GqaCase(kind=kind, num_heads=n, kv_num_heads=nkv, head_size=h,
                           dtype=("fp16", "bf16")[i % 2], kv_layout=(i // 2) % 2,
                           shared=bool(i % 3 == 0), do_rotary=i % 4 < 2,
                           softcap=2.0 if i % 5 == 0 else 0.0,
                           local_window_size=17 if i % 7 == 3 else -1,
                           seed=case_seed(32_000 + i), **kw))  # fmt: skip
    # The prefill's (token, head) rows for groups that leave idle rows or fill a warp with one
    # token's heads (G = 7, 8, 16, 64), and a decode with more splits than a warp has lanes
    # (capacity ~8k over B x Nkv = 2: the merging CTA's split loops run twice).
    for i, ((n, nkv), kind) in enumerate(
        itertools.product(((14, 2), (16, 2), (32, 2), (64, 1)), ["prompt", "chunk"])
    ):
        kw = ({"batch": 2, "seq": 37, "pad": 6} if kind == "prompt"
              else {"batch": 1, "seq": 20, "past_len": 45})  # fmt: skip
        out.append(GqaCase(kind=kind, num_heads=n, kv_num_heads=nkv, head_size=64,
                           dtype=("fp16", "bf16")[i % 2], kv_layout=i % 2, shared=i % 3 == 0,
                           do_rotary=i % 2 == 0, seed=case_seed(33_000 + i), **kw))  # fmt: skip
    # Large softcaps stay at float rounding (no hardware tanh approximation): every kernel.
    for i, (kind, dtype, cap) in enumerate(
        [("decode", "fp16", 1e4), ("prompt", "bf16", 1e6), ("chunk", "fp16", 1e8),
         ("decode", "fp32", 1e6), ("prompt", "fp32", 1e8)]
    ):  # fmt: skip
        kw = ({"batch": 2, "seq": 37, "pad": 6} if kind == "prompt" else
              {"batch": 1, "seq": 20, "past_len": 45} if kind == "chunk" else
              {"batch": 2, "past_len": 300, "pad": 7})  # fmt: skip
        out.append(GqaCase(kind=kind, num_heads=8, kv_num_heads=2, head_size=64, dtype=dtype,
                           kv_layout=i % 2, softcap=cap, seed=case_seed(35_000 + i), **kw))  # fmt: skip
    for i, layout in enumerate((0, 1)):
        out.append(GqaCase(kind="decode", batch=1, past_len=8000, num_heads=8, kv_num_heads=2,
                           head_size=128, dtype=("fp16", "bf16")[i], kv_layout=layout,
                           shared=True, head_sink=i == 1, seed=case_seed(34_000 + i)))  # fmt: skip
    # A short sequence in a large cache (a runtime that reserves the whole context): most of the
    # grid's splits hold no live key and leave at once; the merges take the live prefix (head
    # 256, one KV head; on the H200's 132 SMs, 132 splits targeted): one live split (its output
    # written directly), 3, 16 in one level (the flat cap, kernels.h), 55 in a two-level tree
    # (7 groups of 8, the last of 7).
    for i, past in enumerate((0, 100, 300, 2000, 7000)):
        out.append(GqaCase(kind="decode", batch=1, past_len=past, num_heads=4, kv_num_heads=1,
                           head_size=256, dtype=("fp16", "bf16")[i % 2], kv_layout=i % 2,
                           shared=True, extra_capacity=8192 - past, do_rotary=True,
                           softcap=2.0 if i == 3 else 0.0, seed=case_seed(34_100 + i)))  # fmt: skip
    # Many (batch, kv head) rows, ragged, more than the SMs (on the H200's 132 SMs, four warps,
    # three decode CTAs per SM at head size 128): 160 rows share one wave in 2 splits each; 400
    # rows, more than one wave holds, run one split each with the shared memory padded to two
    # CTAs per SM (MakePlan). Up to one row per SM the wide instance serves (_wide_cases).
    for i, (batch, past) in enumerate(((40, 1000), (100, 300))):
        out.append(GqaCase(kind="decode", batch=batch, past_len=past, pad=13, num_heads=8,
                           kv_num_heads=4, head_size=128, dtype=("fp16", "bf16")[i],
                           kv_layout=1 - i, shared=i == 1, do_rotary=True,
                           seed=case_seed(34_200 + i)))  # fmt: skip
    return out


DISPATCH_CASES = _dispatch_cases()
if QUICK:
    DISPATCH_CASES = DISPATCH_CASES[::11]


@pytest.mark.parametrize("case", DISPATCH_CASES, ids=_label)
def test_dispatch_vs_oracle(case):
    check_oracle(case, ours(case))


@pytest.mark.parametrize("offset", [2, 8])
@pytest.mark.parametrize("kind", ["prompt", "decode", "chunk"])
def test_buffers_at_unaligned_addresses(kind, offset):
    """Caches and output bound `offset` bytes past a 256-byte boundary (2: not even 4-byte
    aligned; 8: not 16-byte aligned) take the element-load and element-store paths: same results
    as the oracle, nothing written outside the bindings."""
    kw = {"prompt": {"batch": 2, "seq": 33, "pad": 4},
          "decode": {"batch": 2, "past_len": 300, "pad": 17},
          "chunk": {"batch": 1, "seq": 18, "past_len": 40}}[kind]  # fmt: skip
    c = GqaCase(
        kind=kind,
        num_heads=8,
        kv_num_heads=2,
        head_size=64,
        dtype="fp16",
        kv_layout=1,
        do_rotary=True,
        seed=case_seed(32_000 + offset),
        **kw,
    )
    feeds, attrs = c.feeds(), c.attrs()
    sess = cuda_session(build_model(feeds, attrs, KV_DOMAIN, c.kv_layout), KV_DOMAIN)
    out_shape, pres_shape = output_shapes(feeds, attrs)
    io = sess.io_binding()
    _, _on_device = bind_inputs(sess, io, feeds)  # alive until the run
    nan_bits = np.full(1, np.nan, np.float16).view(np.uint16)[0]
    slabs = {}
    for name, shape in (("output", out_shape), ("present_key", pres_shape),
                        ("present_value", pres_shape)):  # fmt: skip
        # A slab of NaN with `offset` bytes before the binding and 64 elements after it.
        n = int(np.prod(shape))
        slabs[name] = (device_filled((n + offset // 2 + 64,), np.float16), shape, n)
        io.bind_output(name, DEVICE, 0, np.float16, list(shape), slabs[name][0].data_ptr() + offset)
    sess.run_with_iobinding(io)
    got = []
    for name in ("output", "present_key", "present_value"):
        slab, shape, n = slabs[name]
        flat = from_device(slab).view(np.uint16)
        lo, hi = offset // 2, offset // 2 + n
        assert (flat[:lo] == nan_bits).all() and (flat[hi:] == nan_bits).all(), (
            f"{name}: wrote outside its binding"
        )
        got.append(flat[lo:hi].view(np.float16).reshape(shape))
    check_oracle(c, tuple(got), f"offset {offset}: ")


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_many_features_at_once(layout, dtype):
    """Rotary, softcap, window, bias and smooth softmax together, in every case kind; fp32 is
    checked against the oracle only (ORT's CUDA GQA has no fp32 kernel)."""
    for k, kind in enumerate(KINDS):
        c = GqaCase(num_heads=6, kv_num_heads=2, head_size=128, dtype=dtype, kv_layout=layout,
                    do_rotary=True, rotary_interleaved=bool(k % 2), softcap=4.0,
                    local_window_size=11, attention_bias="bn", smooth_softmax=1,
                    shared=bool(k % 2), seed=case_seed(20_000 + k), **KINDS[kind])  # fmt: skip
        try:
            got = run_case_cuda(c)
        except Exception as e:
            if refusal(c.refusable_features(), e) is None:
                raise
            continue
        check_oracle(c, got)


@pytest.mark.parametrize("layout", [0, 1])
def test_causal_zero(layout):
    c = GqaCase(batch=2, seq=9, pad=3, kv_layout=layout, head_size=64, dtype="fp16",
                seed=case_seed(30_000 + layout))  # fmt: skip
    f, a = c.feeds(), dict(c.attrs(), causal=0)
    try:
        got = run_cuda(cuda_session(build_model(f, a, KV_DOMAIN, layout), KV_DOMAIN), f, a)
    except Exception as e:
        r = refusal(["causal"], e)
        if r is None:
            raise
        pytest.skip(str(r))
    want = ref.gqa_reference(f, a, layout)
    assert_close(got, want, ref.defined_masks(f, a, layout), "fp16", f"causal=0 {c!r}: ")


# --------------------------------------------------------------------------------------------
# Against ORT's own com.microsoft GroupQueryAttention on the CUDA EP
# --------------------------------------------------------------------------------------------
# ORT's CUDA GQA (1.31): float16 / bfloat16 only (no float32 kernel); no attention_bias ("not
# supported in GroupQueryAttention cuda kernel"); no query_seqlens / q-k norm / causal=0 /
# sliding_window_cache in our reading; rotary needs head_size % 16 == 0.  Cases with those are
# left out; anything else ORT refuses at run time skips with ORT's message.  ORT 1.31's CUDA
# kernel may read parts of the contract (settled on ORT 1.32's CPU) differently (e.g. window
# edges, padded prompts): where ORT's own result is off the oracle, the comparison skips and
# says so -- our op is held to the oracle by the tests above either way.
def _ms_ok(c: GqaCase) -> bool:
    return (
        c.dtype in ("fp16", "bf16")
        and not c.attention_bias
        and not c.query_seqlens
        and not c.qk_norm
        and not c.sliding_window_cache
    )


MS_CASES = [c for c in CORE if _ms_ok(c)][:: (9 if QUICK else 2)] + [
    c for c in FEATURE_CASES if _ms_ok(c)
][:: (30 if QUICK else 3)]


@pytest.mark.parametrize("case", MS_CASES, ids=_label)
def test_vs_ort_cuda(case):
    mine = ours(case)
    twin = head_major_twin(case)
    try:
        theirs = run_case_cuda(twin, MS_DOMAIN)
    except NotOnCuda as e:
        pytest.skip(f"ORT's com.microsoft GQA is not on CUDA for this case: {e}")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"ORT's CUDA GQA refuses this case: {str(e)[-300:]}")
    want, masks = twin.reference(), twin.masks()
    try:
        e_ort = assert_close(theirs, want, masks, case.dtype, "ORT vs oracle: ")
    except AssertionError as e:
        pytest.skip(f"ORT's CUDA GQA itself is off the contract oracle here: {str(e)[:500]}")
    mine_hm = (mine[0], hm(mine[1], case.kv_layout), hm(mine[2], case.kv_layout))
    e_ours = assert_close(mine_hm, theirs, masks, case.dtype, f"ours vs ORT CUDA {case!r}: ", 2.0)
    print(f"max errs ours-vs-ORT {e_ours}, ORT-vs-oracle {e_ort}")


# --------------------------------------------------------------------------------------------
# Layout 0 vs layout 1, shared vs unshared, determinism
# --------------------------------------------------------------------------------------------
EQUIV = [c for i, c in enumerate(CORE + FEATURE_CASES) if c.kv_layout == 0 and i % 3 == 0]
if QUICK:
    EQUIV = EQUIV[::10]


def _ulp_tol(a, dtype):
    eps = {"fp32": 2.0**-23, "fp16": 2.0**-10, "bf16": 2.0**-7}[dtype]
    return 1e-6 + eps * np.abs(a)


@pytest.mark.parametrize("case", EQUIV, ids=_label)
def test_layouts_agree(case):
    """The same logical case in layout 0 and layout 1 (unshared and shared): equal outputs
    (within one ulp of the storage type; the kernels should be bit-identical) and equal presents
    after permutation (exactly: rows are copies, or rotary done the same way).  GqaCase draws
    the same logical data whatever the layout."""
    for shared in (False, True):
        c0 = case.replace(kv_layout=0, shared=shared)
        c1 = case.replace(kv_layout=1, shared=shared)
        if "past_key" in c0.feeds():
            assert np.array_equal(
                ref.from_layout(as_f64(c0.feeds()["past_key"]), 0),
                ref.from_layout(as_f64(c1.feeds()["past_key"]), 1),
            ), "harness: the two layouts got different logical pasts"
        r0, r1 = ours(c0), ours(c1)
        what = f"layout 1 vs layout 0 (shared={shared}) {c1!r} {seed_note()}"
        rows, pm0 = c0.masks()
        osel = np.broadcast_to(rows[:, :, None], np.shape(r0[0]))
        a, b = as_f64(r1[0])[osel], as_f64(r0[0])[osel]
        d = np.abs(a - b)
        assert np.all(d <= _ulp_tol(b, case.dtype)), (
            f"output differs by up to {np.nanmax(d):.3g} "
            f"({int(np.sum(~(d <= _ulp_tol(b, case.dtype))))} elements): {what}"
        )
        pm = ref.from_layout(pm0, 0)
        for name, p1, p0 in (("present_key", r1[1], r0[1]), ("present_value", r1[2], r0[2])):
            x = ref.from_layout(as_f64(p1), 1)[pm]
            y = ref.from_layout(as_f64(p0), 0)[pm]
            assert np.array_equal(x, y), (
                f"{name} differs after permutation (max {np.nanmax(np.abs(x - y)):.3g}, "
                f"{int(np.sum(x != y))} elements): {what}"
            )
        check_oracle(c1, r1, f"layout 1 shared={shared}: ")


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("kind", ["prompt", "decode", "chunk"])
def test_shared_equals_unshared(layout, kind):
    """One logical case, once with the past bound to its own buffer (capacity total - S) and
    once through a shared buffer (capacity total + extra): same output, same defined rows."""
    kw = {"prompt": {"seq": 33, "pad": 9}, "decode": {"past_len": 77, "pad": 30},
          "chunk": {"seq": 9, "past_len": 41}}[kind]  # fmt: skip
    base = GqaCase(batch=1 if kind == "chunk" else 2, kind=kind, num_heads=8, kv_num_heads=2,
                   head_size=128, dtype="fp16", kv_layout=layout, do_rotary=True,
                   seed=case_seed(40_000 + layout), **kw)  # fmt: skip
    un = base.replace(shared=False)
    sh = base.replace(shared=True, extra_capacity=6)
    f_un, f_sh = un.feeds(), dict(sh.feeds())
    for k in ("query", "key", "value", "cos_cache", "sin_cache"):
        if f_un.get(k) is not None:
            f_sh[k] = f_un[k]
    if "past_key" in f_un and kind != "prompt":
        P = f_un["past_key"].shape[2]
        for k in ("past_key", "past_value"):
            lg = ref.from_layout(f_sh[k], layout)
            lg[:, :, :P] = ref.from_layout(f_un[k], layout)
            f_sh[k] = ref.to_layout(lg, layout)
    sh = sh.replace(_feeds=f_sh)
    r_un, r_sh = ours(un), ours(sh)
    check_oracle(un, r_un, "unshared: ")
    check_oracle(sh, r_sh, "shared: ")
    rows, _ = un.masks()
    osel = np.broadcast_to(rows[:, :, None], r_un[0].shape)
    d = np.abs(as_f64(r_un[0]) - as_f64(r_sh[0]))[osel]
    assert np.all(d <= _ulp_tol(as_f64(r_un[0])[osel], "fp16")), (
        f"shared vs unshared output differs by {d.max():.3g} {seed_note()}"
    )
    _, pm_un = un.masks()
    cu = pm_un.shape[2]
    for p_un, p_sh in ((r_un[1], r_sh[1]), (r_un[2], r_sh[2])):
        a = ref.from_layout(as_f64(p_un), layout)
        b = ref.from_layout(as_f64(p_sh), layout)[:, :, :cu]
        m = ref.from_layout(pm_un, layout)
        assert np.array_equal(a[m], b[m]), f"shared vs unshared presents differ {seed_note()}"


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_deterministic(layout, dtype):
    """Repeated runs give bit-identical results (split-K merges are deterministic)."""
    for kind, kw in (("decode", {"past_len": 1000, "batch": 2, "pad": 100}),
                     ("prompt", {"seq": 200, "batch": 2, "pad": 31}),
                     ("chunk", {"seq": 40, "past_len": 300})):  # fmt: skip
        c = GqaCase(kind=kind, num_heads=8, kv_num_heads=2, head_size=128, dtype=dtype,
                    kv_layout=layout, do_rotary=True, seed=case_seed(50_000), **kw)  # fmt: skip
        a = ours(c)
        b = ours(c)
        for name, x, y in zip(("output", "present_key", "present_value"), a, b, strict=True):
            assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), (
                f"{kind}: {name} differs between two identical runs {c!r}"
            )
        if kind == "decode":  # long decode: the split-K path against the oracle too
            check_oracle(c, a)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize(
    "heads,batch,past_len,big_cap,extra",
    [((8, 2, 128), 2, 1000, 5000, {}),  # the splits merge in one level
     # On sm_90 the grids of at most 8 splits are one thread-block cluster per row, merged
     # through its shared memory: 1000 keys (8 splits) against the larger grid in `flat` and
     # here with 16 rows and a head sink (the global merge where the larger grid has no
     # clusters: sm_80, ORT_KVLAYOUT_DECODE_CLUSTERS=0, or more splits than one cluster without
     # group clusters; with group clusters, clusters of 8 of which the first holds the live
     # splits); then 3 splits against 8, of which 5 (6 in the shorter entry's row) leave at once
     ((16, 1, 64), 1, 1000, 5000, {"head_sink": True}),
     ((8, 2, 128), 2, 300, 1001, {}),
     # 47 live splits x 4 rows x 256 floats: a two-level tree (16 splits of one level would read
     # 563 keys, 563 KB of K and V each: above kDecodeFlatSplitBytes, kernels.h); on sm_90 with
     # group clusters, groups of 8 instead (the tree of sm_80: the test after this one)
     ((4, 1, 256), 2, 9000, 12000, {}),
     # 24 splits targeted (a two-round merge at four warps: three quarters of the SMs), 23 live
     # (one level: 23 x 7 rows x 128 floats, 176 keys each; the one-level bound, 36 splits at 7
     # rows, capped the 33 targeted before the two-round rule). The plan runs the wide instance
     # (eight warps, one-round merge, no group clusters); with ORT_KVLAYOUT_DECODE_WIDE=0 (the
     # test after this one) four warps and, on sm_90, group clusters: clusters of 8, 8 and 7 live
     # splits, each merged in its shared memory, then the three groups
     ((28, 4, 128), 1, 4000, 9000, {}),
     # About 2000 keys: 16 live splits of 128 keys in a grid of 16 (capacity 2001) and of 24
     # (9000). Four warps on sm_90 with group clusters: two clusters of 8 live splits, then the
     # two groups; the larger grid adds a cluster whose CTAs all leave at once, and its group
     # slots lie further on (after 24 split slots, not 16)
     ((28, 4, 128), 1, 2000, 9000, {}),
     # The wide instance (eight warps) with 8 live splits: one cluster merged through its shared
     # memory (capacity 1001, sm_90) against a flat global merge of the same 8 in a grid of 24
     ((28, 4, 128), 1, 1000, 9000, {}),
     # The wide instance at more than 16 rows up to one per SM (one CTA of eight warps per SM,
     # no clusters): 18 rows at head tile 64, a grid of 4 splits (capacity 501) against 7 of
     # which 4 are live; 24 rows at head tile 128, 3 against 5
     ((9, 3, 64), 6, 500, 5000, {}),
     ((32, 8, 128), 3, 300, 3000, {}),
     # 9/3/64 at one entry over 3000 keys: at kv_layout=1 with packed heads forced (the child
     # of test_decode_packed_heads_forced) one CTA row of 9 query rows, its splits in group
     # clusters on sm_90, against a larger grid
     ((9, 3, 64), 1, 3000, 9000, {})],
    ids=["flat", "clusters_sink", "clusters", "two_levels", "flat_capped", "group_clusters",
         "wide_cluster_vs_global", "wide_rows_hd64", "wide_rows_hd128", "packed_one_entry"],
)  # fmt: skip
def test_decode_bits_do_not_depend_on_the_capacity(
    layout, dtype, heads, batch, past_len, big_cap, extra
):
    """The same live keys in a cache of past + 1 rows and a larger one (shared buffers, the rows
    past the live ones random) give bit-identical output: the key splits and their merge tree
    follow the live length, not the capacity that sized the grid. A runtime that grows a packed
    cache (bucket mode) then generates the same tokens as one that reserved the whole context."""
    n, nkv, h = heads
    c = GqaCase(kind="decode", past_len=past_len, batch=batch, pad=100, num_heads=n,
                kv_num_heads=nkv, head_size=h, dtype=dtype, kv_layout=layout, shared=True, do_rotary=True,
                seed=case_seed(50_001), **extra)  # fmt: skip
    small = c.feeds()
    rng = np.random.default_rng(case_seed(50_002))
    big = dict(small)
    for name in ("past_key", "past_value"):
        logical = ref.from_layout(small[name], layout)  # (B, Nkv, C, H)
        b, nk, cap, hs = logical.shape
        tail = rng.standard_normal((b, nk, big_cap - cap, hs)).astype(logical.dtype)
        big[name] = ref.to_layout(np.concatenate([logical, tail], axis=2), layout)
    out_small = run_case_cuda(c, feeds=small)[0]
    out_big = run_case_cuda(c, feeds=big)[0]
    assert np.array_equal(out_small.view(np.uint8), out_big.view(np.uint8)), (
        f"decode output differs between capacities {past_len + 1} and {big_cap}: max abs "
        f"{np.abs(out_small.astype(np.float64) - out_big.astype(np.float64)).max():.3g} {c!r}"
    )
    check_oracle(c, run_case_cuda(c, feeds=small))


@pytest.mark.parametrize(
    "setting",
    ["ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS=0", "ORT_KVLAYOUT_DECODE_CLUSTERS=0",
     "ORT_KVLAYOUT_DECODE_WIDE=0"],
)  # fmt: skip
def test_decode_bits_do_not_depend_on_the_capacity_without_group_clusters(setting):
    """On sm_90 the capacity cases of more than 8 splits at 4/1/256 take group clusters, and at
    28/4/128 the wide instance (eight warps, a global merge); the global merges group clusters
    replace (one level, and the two-level tree) still serve sm_80 and the first two settings, and
    with the third 28/4/128 takes four warps and group clusters (the kernel of calls the wide
    instance does not serve: a head sink, a softcap, several tokens). The same cases again in a
    child process with the setting (the library reads it once per process): bit-identical across
    capacities and right by the oracle."""
    name, value = setting.split("=")
    cases = "two_levels or flat_capped or group_clusters"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
         f"{__file__}::test_decode_bits_do_not_depend_on_the_capacity", "-k", f"fp16 and ({cases})"],
        capture_output=True, text=True, timeout=600, check=False,
        env=dict(os.environ, **{name: value}),
    )  # fmt: skip
    tail = (p.stdout + p.stderr)[-3000:]
    assert p.returncode == 0, f"with {setting}: the child pytest failed {seed_note()}:\n{tail}"
    assert re.search(r"\b6 passed\b", p.stdout), f"with {setting}: not 6 cases passed:\n{tail}"


def _wide_cases() -> list[GqaCase]:
    # (heads, batch, past, extra capacity): calls of one token the plan gives the wide instance
    # (MakePlan). Few (batch, kv head) rows whose merge takes two rounds at four warps, head
    # tile 128: G = 7 at one live split, 6 live in a grid of 8 (on sm_90 one cluster of
    # eight-warp CTAs), 24 live of 24 (a flat global merge) twice; three entries (12 rows),
    # ragged; head size 112 in the 128 tile (padding columns); G = 16 (16 rows, the whole tile:
    # still two rounds at eight warps). Head tile 64 at few rows: G = 16 (two rounds). From 17
    # rows to one per SM (one CTA per SM): 24 rows at head tile 128, 20 ragged at G = 4, 24 at
    # head tile 64 (9/3/64 B=8), 18 at G = 7, head size 40 in the 64 tile, 20 at 28/4/128 (two
    # rounds, a split merge of 6 in one CTA per SM).
    specs = [((28, 4, 128), 1, 5, 0), ((28, 4, 128), 1, 700, 300), ((28, 4, 128), 1, 3000, 0),
             ((28, 4, 128), 1, 12000, 4000), ((28, 4, 128), 3, 2000, 0),
             ((14, 2, 112), 2, 900, 64), ((32, 2, 128), 1, 5000, 0),
             ((32, 2, 64), 1, 3000, 0),
             ((32, 8, 128), 3, 1500, 0), ((16, 4, 128), 5, 600, 100), ((9, 3, 64), 8, 2000, 0),
             ((14, 2, 64), 9, 900, 50), ((12, 4, 40), 5, 700, 0), ((28, 4, 128), 5, 800, 0)]  # fmt: skip
    out = []
    for i, ((n, nkv, h), batch, past, extra) in enumerate(specs):
        for layout in (0, 1):
            out.append(GqaCase(kind="decode", batch=batch, past_len=past,
                               pad=min(past - 1, 37) if batch > 1 else 0, num_heads=n,
                               kv_num_heads=nkv, head_size=h,
                               dtype=("fp16", "bf16")[(i + layout) % 2], kv_layout=layout,
                               shared=extra > 0 or i in (0, 4, 13),
                               extra_capacity=extra, do_rotary=i % 3 != 1,
                               seed=case_seed(50_200 + 2 * i + layout)))  # fmt: skip
    return out


@pytest.mark.parametrize("case", _wide_cases(), ids=_label)
def test_decode_wide_instance_vs_oracle(case):
    """The calls the plan gives the wide decode instance (eight warps, one token, head tile 128
    or 64: few rows whose merge would take two rounds at four warps, or more than 16 rows up to
    one per SM): right by the oracle, and two runs bit-identical (the warps merge in a fixed
    order)."""
    a = ours(case)
    check_oracle(case, a)
    b = ours(case)
    assert np.array_equal(np.asarray(a[0]).view(np.uint8), np.asarray(b[0]).view(np.uint8)), (
        f"output differs between two identical runs {case!r}"
    )


def _packed_cases() -> list[GqaCase]:
    # (heads, batch, past, extra capacity): one-token calls at kv_layout=1 that packed heads serve
    # (DecodePackedServes: head size 64, 2 or 3 kv heads, Nkv x G <= 16 rows). By default packed
    # heads serve where DecodePackedRule says (here the 64-entry case on 132 SMs, at eight warps);
    # test_decode_packed_heads_forced runs every case packed (ORT_KVLAYOUT_DECODE_PACKED=2), those
    # of 3 kv heads (tile 192) at eight warps and at four, those of 2 (tile 128) at four. 9/3/64
    # (tile 192, 9 rows): one entry (few rows: a cluster of splits), one entry over 3000 keys
    # (group clusters on sm_90 at four warps), three ragged entries, 64 entries (the rule's 128
    # CTAs on 132 SMs: two splits each); 14/2/64 (tile 128, 14 rows): two entries, nine ragged;
    # 4/2/64 (G = 2); 16/2/64 (G = 8: the whole 16-row tile); 12/3/64 (12 rows) over 20000 keys (a
    # merge tree); 6/3/64 over 129 keys (one split).
    specs = [((9, 3, 64), 1, 5, 0), ((9, 3, 64), 1, 3000, 500), ((9, 3, 64), 3, 900, 0),
             ((9, 3, 64), 64, 300, 40), ((14, 2, 64), 2, 1500, 0), ((14, 2, 64), 9, 600, 64),
             ((4, 2, 64), 1, 700, 0), ((16, 2, 64), 2, 2000, 100), ((12, 3, 64), 1, 20000, 0),
             ((6, 3, 64), 5, 128, 0)]  # fmt: skip
    out = []
    for i, ((n, nkv, h), batch, past, extra) in enumerate(specs):
        out.append(GqaCase(kind="decode", batch=batch, past_len=past,
                           pad=min(past - 1, 37) if batch > 1 else 0, num_heads=n,
                           kv_num_heads=nkv, head_size=h, dtype=("fp16", "bf16")[i % 2],
                           kv_layout=1, shared=extra > 0 or i in (0, 4, 9),
                           extra_capacity=extra, do_rotary=i % 3 != 1,
                           seed=case_seed(50_400 + i)))  # fmt: skip
    return out


@pytest.mark.parametrize("case", _packed_cases(), ids=_label)
def test_decode_packed_heads_vs_oracle(case):
    """One-token calls at kv_layout=1 of 2 or 3 kv heads of size 64, which packed heads can serve
    (one CTA per batch entry for all its kv heads, whole token rows): right by the oracle, the
    appended rows of every kv head included, and two runs bit-identical."""
    a = ours(case)
    check_oracle(case, a)
    b = ours(case)
    for name, x, y in zip(("output", "present_key", "present_value"), a, b, strict=True):
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), (
            f"{name} differs between two identical runs {case!r}"
        )


@pytest.mark.skipif(QUICK, reason="a child pytest: outside the sanitizer subset")
@pytest.mark.parametrize("wide", [None, "0"], ids=["eight_warps", "four_warps"])
def test_decode_packed_heads_forced(wide):
    """With ORT_KVLAYOUT_DECODE_PACKED=2 packed heads serve every call they can (in a child
    pytest: the library reads the setting once per process), at the 192-column tile in eight
    warps where that instance fits the device, else and with ORT_KVLAYOUT_DECODE_WIDE=0 in four:
    the packed cases, the capacity cases whose shapes they serve (bits independent of the
    capacity) and the non-finite decode cases (a NaN or Inf in one kv head's rows reaches only
    that head's query rows, which share the packed CTA with the other heads' rows) all pass."""
    from test_gqa_nonfinite import _DECODE_EDITS

    # The non-finite decode cases on the GPU (2 dtypes x 2 lengths x 2 layouts each), the packed
    # cases, and two capacity cases in 2 dtypes x 2 layouts.
    want = len(_DECODE_EDITS) * 8 + len(_packed_cases()) + 2 * 4
    here = os.path.dirname(__file__)
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
         f"{__file__}::test_decode_packed_heads_vs_oracle",
         f"{__file__}::test_decode_bits_do_not_depend_on_the_capacity",
         os.path.join(here, "test_gqa_nonfinite.py") + "::test_decode_nonfinite_as_ort",
         "-k", "packed or wide_rows_hd64 or nonfinite"],
        capture_output=True, text=True, timeout=900, check=False,
        env={**{k: v for k, v in os.environ.items() if k != "ORT_KVLAYOUT_DECODE_WIDE"},
             "ORT_KVLAYOUT_DECODE_PACKED": "2",
             **({"ORT_KVLAYOUT_DECODE_WIDE": wide} if wide else {})},
    )  # fmt: skip
    tail = (p.stdout + p.stderr)[-3000:]
    assert p.returncode == 0, f"packed heads forced: the child pytest failed {seed_note()}:\n{tail}"
    assert re.search(rf"\b{want} passed\b", p.stdout), f"not {want} cases passed:\n{tail}"


# (heads, batch, past, features): one-token calls and the warps MakePlan gives their decode
# kernel: 8 (the wide instance) where it serves the call and the rows are at most one per SM
# and either more than 16 or their merge takes two rounds at four warps; else 4.
_PLAN_WARPS_CASES = [
    ((28, 4, 128), 1, 4000, {}),  # 4 rows, G = 7 at head size 128: two rounds
    ((32, 2, 64), 1, 4000, {}),  # 2 rows, G = 16 at head size 64: two rounds
    ((32, 8, 128), 1, 4000, {}),  # 8 rows, one round
    ((9, 3, 64), 4, 4000, {}),  # 12 rows, one round
    ((28, 4, 128), 1, 4000, {"head_sink": True}),  # not the plain form: no wide instance
    ((32, 8, 128), 2, 1000, {}),  # 16 rows, one round
    ((28, 4, 128), 4, 1000, {}),  # 16 rows, two rounds
    ((32, 8, 128), 3, 1000, {}),  # 24 rows
    ((9, 3, 64), 32, 1000, {}),  # 96 rows
    ((12, 4, 40), 5, 700, {}),  # 20 rows, head size 40 in the 64 tile
    ((28, 4, 128), 64, 300, {}),  # 256 rows: more than the SMs of the GPUs we know
    ((4, 1, 256), 24, 1000, {}),  # head tile 256: no wide instance
    ((32, 8, 32), 4, 1000, {}),  # head tile 32: none either
    # kv_layout=1, 192 rows: packed heads (tile 192, eight warps; DecodePackedRule), with
    # ORT_KVLAYOUT_DECODE_PACKED=0 per-head CTAs of four warps
    ((9, 3, 64), 64, 300, {}),
    ((9, 3, 64), 64, 300, {}),  # kv_layout=0: per-head CTAs, four warps
    ((9, 3, 64), 44, 300, {}),  # kv_layout=1, 132 rows: per-head, eight warps (on 132 SMs)
    ((14, 2, 64), 70, 300, {}),  # kv_layout=0, 140 rows: per-head
    ((14, 2, 64), 70, 300, {}),  # kv_layout=1, 2 kv heads: per-head (the rule takes 3)
    ((9, 3, 64), 48, 300, {}),  # kv_layout=0: per-head
    ((9, 3, 64), 48, 300, {}),  # kv_layout=1, 144 rows, 96 packed CTAs: per-head (fill)
    ((9, 3, 64), 128, 300, {}),  # kv_layout=0: per-head
    ((9, 3, 64), 128, 300, {}),  # kv_layout=1, 128 packed CTAs (one split each): packed
]


# The wide instance's shared memory (DecSmemBytes at eight warps, fp16): 144 KB at head tile 64,
# 136 KB at 128, and 200 KB for packed heads at 192. Where less fits a block (sm_86, sm_89; sm_80
# for packed heads), DecodeTcWideServes says no.
_WIDE_SMEM = {64: 144 * 1024, 128: 136 * 1024}
_PACKED_WIDE_SMEM = 200 * 1024


def _head_tile(head_size: int) -> int:  # DecHeadDim: a multiple of 32
    return (head_size + 31) // 32 * 32


def _plan_warps(
    heads, batch, layout: int, sms: int, smem_optin: int, features: dict, packed: str | None
) -> tuple[int, int]:
    """(head tile, warps) of the decode kernel MakePlan gives a one-token call, with
    ORT_KVLAYOUT_DECODE_PACKED unset or `packed`."""
    n, nkv, h = heads
    rows, g = batch * nkv, n // nkv
    tile = _head_tile(h)
    # Where packed heads serve (DecodePackedServes; every feature in these cases, a head sink,
    # takes the kernel's full form, not the plain one), and their eight-warp instance.
    serves = layout == 1 and nkv in (2, 3) and h == 64 and nkv * g <= 16 and not features
    eight = nkv == 3 and smem_optin >= _PACKED_WIDE_SMEM
    if packed == "2" and serves:
        return nkv * h, 8 if eight else 4
    if packed != "0" and serves and nkv == 3 and rows > sms and eight:
        # Packed CTAs (MakePlan at 9 rows, a two-round merge, one CTA of eight warps per SM): B x
        # the split target, which must fill their last round of one CTA per SM to 90%.
        ctas = batch * max(1, sms // batch)
        if ctas % sms == 0 or ctas % sms * 10 >= sms * 9:
            return nkv * h, 8  # packed heads (DecodePackedRule): whole token rows of 3 kv heads
    served = tile in _WIDE_SMEM and not features
    two_rounds = g * h // 4 > 128  # DecodeMergeTwoRounds at four warps
    return tile, 8 if served and rows <= sms and (two_rounds or rows > 16) else 4


@pytest.mark.skipif(EMULATE, reason="kernel names need the CUDA EP")
@pytest.mark.skipif(QUICK, reason="checks the plan, not memory: outside the sanitizer subset")
@pytest.mark.parametrize("packed", [None, "0", "2"], ids=["default", "packed_off", "packed_forced"])
def test_plan_gives_the_decode_warps(packed):
    """The decode kernel that runs, by its name in a CUPTI trace (torch's profiler, in a child
    process): eight warps (W = 8 in DecodeTcKernel<T, HD, form, W>) exactly where MakePlan's rule
    says, four elsewhere, and one decode launch per call; by default the packed heads' tile of 3
    x 64 columns (HD = 192) at eight warps exactly where their rule says (kv_layout=1, 3 kv heads,
    more rows than SMs, CTAs that fill their last round), with ORT_KVLAYOUT_DECODE_PACKED=0
    never, with 2 wherever they serve (the 128-column tile of 2 kv heads at four warps)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch (its profiler reads the kernel names)")
    specs = []
    for i, (heads, batch, past, features) in enumerate(_PLAN_WARPS_CASES):
        n, nkv, h = heads
        specs.append(dict(kind="decode", batch=batch, past_len=past, num_heads=n,
                          kv_num_heads=nkv, head_size=h, dtype="fp16", kv_layout=i % 2,
                          shared=True, do_rotary=True, seed=case_seed(50_300 + i), **features))  # fmt: skip
    knobs = {"ORT_KVLAYOUT_DECODE_PACKED": packed} if packed else None
    rc, recs, log = run_decode_kernels_child(specs, knobs=knobs)
    if rc == 0 and log.startswith("SKIP "):
        pytest.skip(log.splitlines()[0][5:])
    assert rc == 0 and len(recs) == len(specs), f"the child failed {seed_note()}:\n{log[-3000:]}"
    if recs[0]["smem_optin"] < max(_WIDE_SMEM.values()):
        pytest.skip(f"the rule's bounds are those of an SM with 144 KB of shared memory per block "
                    f"or more (this one: {recs[0]['smem_optin']} bytes)")  # fmt: skip
    for i, ((heads, batch, _, features), rec) in enumerate(
        zip(_PLAN_WARPS_CASES, recs, strict=True)
    ):
        want_tile, want = _plan_warps(
            heads, batch, i % 2, rec["sms"], rec["smem_optin"], features, packed
        )
        ours_ = [k for k in rec["kernels"] if "DecodeTcKernel<" in k]
        assert len(ours_) == 1, f"{heads} B={batch}: not one decode launch: {rec['kernels']}"
        m = re.search(r"DecodeTcKernel<[^,<>]+, (\d+), [^,<>]+, (\d+)(?:, [^,<>]+)?>", ours_[0])
        assert m, f"{heads} B={batch}: no template arguments in {ours_[0]!r}"
        tile, warps = int(m.group(1)), int(m.group(2))
        assert tile == want_tile, f"{heads} B={batch}: head tile {tile} in {ours_[0]!r}"
        assert warps == want, (
            f"{heads} B={batch} {features} on {rec['sms']} SMs: {warps} warps, the plan's rule "
            f"says {want} ({ours_[0]!r})"
        )


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("kind", ["prompt", "prompt_odd", "chunk", "decode"])
def test_nonfinite_rows_past_the_live_keys_do_not_leak(kind, layout):
    """A shared cache may hold anything in the rows past each entry's live keys (a reused or
    freshly mapped buffer): NaN keys and infinite values there leave the output as the contract
    (and ORT's op, which never reads them) gives it. This covers every kernel that serves the
    call (cuDNN's prefill for S >= 64 fp16 included, whose last key tile reads rows past an
    entry's length: a masked score times an infinite value would be NaN), in both layouts, with a
    ragged batch (rows past the shorter entry's length lie below the total length)."""
    seq = {"prompt": 128, "prompt_odd": 100, "chunk": 96, "decode": 1}[kind]
    kind = kind.removesuffix("_odd")  # a prompt whose length ends inside a 128-key tile
    c = GqaCase(kind=kind, seq=seq, past_len=0 if kind == "prompt" else 300, batch=2, pad=37,
                num_heads=8, kv_num_heads=2, head_size=128, dtype="fp16", kv_layout=layout,
                shared=True, extra_capacity=200, do_rotary=True, query_seqlens=kind == "chunk",
                seed=case_seed(50_101))  # fmt: skip
    feeds = dict(c.feeds())
    past, _, _, _ = c.lengths()
    for name, value in (("past_key", np.nan), ("past_value", np.inf)):
        logical = ref.from_layout(feeds[name], layout).copy()  # (B, Nkv, C, H)
        for b in range(c.batch):
            logical[b, :, int(past[b]) :] = value  # the call writes its new rows over some
        feeds[name] = ref.to_layout(logical, layout)
    got = run_case_cuda(c, feeds=feeds)
    assert np.isfinite(np.asarray(got[0], np.float64)).all(), f"non-finite output: {c!r}"
    check_oracle(c, got)


# --------------------------------------------------------------------------------------------
# sliding_window_cache=1 (CONTRACT section 8): a window-sized cache (capacity C >= W) whose rows
# shift as tokens arrive. The CUDA op stages the resident rows in its workspace, so past and
# present may be one buffer; every kernel that can serve the call reads the window.
# --------------------------------------------------------------------------------------------
# (name, GqaCase fields). W = local_window_size, C = W + extra_capacity.
SWC_SCENARIOS = {
    # First prompts (a right-padded one is refused by contract): S > C (tensor-core prefill for
    # fp16/bf16), S between W and C, S < W, one token.
    "prompt_S_gt_C": {"kind": "prompt", "seq": 40, "local_window_size": 8, "extra_capacity": 3},
    "prompt_W_lt_S_le_C": {"kind": "prompt", "seq": 10, "local_window_size": 8,
                           "extra_capacity": 3},
    "prompt_S_lt_W": {"kind": "prompt", "seq": 5, "batch": 2, "local_window_size": 8},
    "prompt_S1": {"kind": "prompt", "seq": 1, "batch": 3, "local_window_size": 4},
    # Decode: cache not yet full, exactly full, shifting (C == W: every step; C > W: every
    # C - W + 1 steps), ragged batches, a long window (decode kernel splits).
    "decode_filling": {"kind": "decode", "past_len": 3, "local_window_size": 8},
    "decode_full": {"kind": "decode", "past_len": 8, "local_window_size": 8},
    "decode_C_eq_W": {"kind": "decode", "past_len": 29, "batch": 3, "pad": 7,
                      "local_window_size": 8},
    "decode_C_gt_W": {"kind": "decode", "past_len": 47, "batch": 2, "pad": 5,
                      "local_window_size": 8, "extra_capacity": 5},
    "decode_long": {"kind": "decode", "past_len": 700, "batch": 2, "pad": 260,
                    "local_window_size": 200, "extra_capacity": 57},
    # Chunked prefill: chunks smaller and larger than the drop group, larger than C (S >= 16:
    # tensor-core prefill), and ragged chunks through query_seqlens.
    "chunk_small": {"kind": "chunk", "seq": 3, "past_len": 10, "local_window_size": 4,
                    "extra_capacity": 2},
    "chunk_gt_C": {"kind": "chunk", "seq": 20, "past_len": 30, "local_window_size": 8,
                   "extra_capacity": 2},
    "chunk_qsl": {"kind": "chunk", "seq": 6, "past_len": 23, "batch": 3, "pad": 4,
                  "query_seqlens": True, "local_window_size": 8, "extra_capacity": 1},
    # A full window of 128 rows (C == W) and a 2-token chunk: the live keys (129) outnumber the
    # cache's rows, so the splits must be counted on the staging rows, not on C.
    "chunk_full_window_128": {"kind": "chunk", "seq": 2, "past_len": 300,
                              "local_window_size": 128},
}  # fmt: skip
SWC_HEADS = ((8, 2, 64), (6, 3, 40), (4, 1, 128), (8, 2, 96))


def _swc_fields(i, **_):
    n, nkv, h = SWC_HEADS[i % len(SWC_HEADS)]
    rot = i % 3 != 0
    return {
        "num_heads": n,
        "kv_num_heads": nkv,
        "head_size": h,
        "do_rotary": rot,
        "position_ids": rot and i % 4 == 1,
        "softcap": 30.0 if i % 5 == 2 else 0.0,
        "sliding_window_cache": True,
        "seed": case_seed(80_000 + i),
    }


SWC_CASES = grid_cases(
    {"scenario": SWC_SCENARIOS, "dtype": ["fp32", "fp16", "bf16"], "layout": [0, 1],
     "shared": [False, True]},
    _swc_fields,
)  # fmt: skip
if QUICK:
    SWC_CASES = SWC_CASES[::7]


@pytest.mark.parametrize("case", SWC_CASES, ids=_label)
def test_sliding_window_cache_vs_oracle(case):
    """Output and the window-sized present against the float64 oracle (no refusal allowed:
    the CUDA op implements sliding_window_cache)."""
    check_oracle(case, run_case_cuda(case, KV_DOMAIN))


SWC_ORT = [c for c in SWC_CASES if c.dtype in ("fp32", "fp16") and not c.shared]
if not QUICK:
    SWC_ORT = SWC_ORT[::2]


@pytest.mark.parametrize("case", SWC_ORT, ids=_label)
def test_sliding_window_cache_vs_ort_cpu(case):
    """The same call against ORT's own com.microsoft kernel on the CPU EP (its CUDA kernel has
    no sliding_window_cache in our reading), on the head-major twin."""
    import onnxruntime as ort

    if case.query_seqlens and tuple(int(x) for x in ort.__version__.split(".")[:2]) < (1, 32):
        pytest.skip(f"onnxruntime {ort.__version__}'s GQA has no query_seqlens input (1.32+)")
    mine = run_case_cuda(case, KV_DOMAIN)
    twin = head_major_twin(case)
    theirs = twin.run(MS_DOMAIN)
    masks = twin.masks()
    e_ort = assert_close(theirs, twin.reference(), masks, case.dtype, "ORT CPU vs oracle: ")
    mine_hm = (mine[0], hm(mine[1], case.kv_layout), hm(mine[2], case.kv_layout))
    e_ours = assert_close(mine_hm, theirs, masks, case.dtype, f"ours vs ORT CPU {case!r}: ", 2.0)
    print(f"max errs ours-vs-ORT-CPU {e_ours}, ORT-vs-oracle {e_ort}")


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_sliding_window_generation_loop_on_device(layout, dtype):
    """A prompt longer than the window, decode steps through several shifts, a chunk and more
    decode steps, on one shared window-sized cache that never leaves the device (the
    onnxruntime-genai flow for a sliding-window layer), step by step against the oracle."""
    base = GqaCase(batch=2, num_heads=8, kv_num_heads=2, head_size=64, dtype=dtype,
                   kv_layout=layout, do_rotary=True, shared=True, packed=True,
                   local_window_size=6, sliding_window_cache=True)  # fmt: skip
    # Both entries start with a 13-token prompt (no right padding with a window-sized cache);
    # the chunk is ragged through query_seqlens (lengths 3 and 5).
    plan = [("prompt", 13)] + [("decode", 1)] * 7 + [("chunk", 5)] + [("decode", 1)] * 4
    rng = np.random.default_rng(case_seed(81_000 + layout))
    _loop_on_device(base, 9, 128, np.array([13, 13]), plan, rng, chunk_may_be_refused=False)


# --------------------------------------------------------------------------------------------
# Generation loop on the device: prompt, decode steps, a chunk, on one shared cache that never
# leaves the GPU (the onnxruntime-genai flow), checked step by step against the oracle.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_generation_loop_on_device(layout, dtype):
    base = GqaCase(batch=2, num_heads=8, kv_num_heads=2, head_size=64, dtype=dtype,
                   kv_layout=layout, do_rotary=True, shared=True, packed=True)  # fmt: skip
    # Steps: a right-padded prompt (lengths 13 and 6), 6 decode steps, one query_seqlens chunk
    # of 5 (lengths 3 and 5; skipped if refused), 3 decode steps.
    plan = [("prompt", 13)] + [("decode", 1)] * 6 + [("chunk", 5)] + [("decode", 1)] * 3
    rng = np.random.default_rng(case_seed(60_000 + layout))
    _loop_on_device(base, 96, 96 + 8, np.array([13, 6]), plan, rng, chunk_may_be_refused=True)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_decode_rows_idle_through_query_seqlens(layout, dtype):
    """One-token steps where query_seqlens idles an entry (0 rows: its cache and length stay;
    the serving engine's packed calls feed them): each step against the oracle, whose present
    mask covers the idle entry's rows, so a write to them fails the step."""
    base = GqaCase(batch=3, num_heads=8, kv_num_heads=2, head_size=128, dtype=dtype,
                   kv_layout=layout, do_rotary=True, shared=True, packed=True)  # fmt: skip
    plan = [("prompt", 13)] + [("decode", 1)] * 2 + [
        ("decode", 1, [1, 0, 1]), ("decode", 1, [0, 1, 1]), ("decode", 1, [0, 0, 1]),
        ("decode", 1, [1, 1, 1]), ("decode", 1),
    ]  # fmt: skip
    rng = np.random.default_rng(case_seed(82_000 + layout))
    _loop_on_device(base, 64, 64 + 8, np.array([13, 6, 9]), plan, rng, chunk_may_be_refused=False)


def _loop_on_device(base: GqaCase, capacity, positions, T, plan, rng, chunk_may_be_refused):
    """Runs ``plan`` ((kind, S) steps, or ("decode", 1, query_seqlens); a chunk is ragged
    through query_seqlens 3 and 5) with
    ``base``'s sizes and attributes on one shared cache of ``capacity`` rows (random at first)
    that never leaves the device, the entries at lengths ``T`` after the prompt; each step
    against the oracle fed a host copy of the cache before the step. A chunk the op refuses by
    its query_seqlens is left out where ``chunk_may_be_refused``."""
    B, N, Nkv, H = base.batch, base.num_heads, base.kv_num_heads, base.head_size
    layout, dtype, dt, attrs = base.kv_layout, base.dtype, base.np_dtype, base.attrs()
    cos, sin = rotary_caches(H, positions, dt)
    kbuf = to_device(ref.to_layout(rng.standard_normal((B, Nkv, capacity, H)).astype(dt), layout))
    vbuf = to_device(ref.to_layout(rng.standard_normal((B, Nkv, capacity, H)).astype(dt), layout))
    sessions = {}
    for step, (kind, S, *given) in enumerate(plan):
        qsl = None
        if kind == "prompt":
            newT = T
        elif kind == "decode" and given:  # entries with 0 rows idle at their length
            qsl = np.array(given[0], np.int32)
            newT = T + qsl
        elif kind == "decode":
            newT = T + 1
        else:
            qsl = np.array([3, 5], np.int32)
            newT = T + qsl
        total = int(newT.max()) if kind != "prompt" else S
        feeds = {
            "query": rng.standard_normal((B, S, (N + 2 * Nkv) * H)).astype(dt),
            "past_key": None,
            "past_value": None,
            "seqlens_k": (newT - 1).astype(np.int32),
            "total_sequence_length": np.array(total, np.int32),
            "cos_cache": cos,
            "sin_cache": sin,
        }
        if qsl is not None:
            feeds["query_seqlens"] = qsl
        past_k, past_v = from_device(kbuf), from_device(vbuf)  # host copies for the oracle
        ref_feeds = dict(feeds, past_key=past_k, past_value=past_v)
        key = (kind, qsl is not None)
        if key not in sessions:
            sessions[key] = cuda_session(build_model(ref_feeds, attrs, KV_DOMAIN, layout),
                                         KV_DOMAIN)  # fmt: skip
        sess = sessions[key]
        io = sess.io_binding()
        _, _on_device = bind_inputs(sess, io, feeds)  # past: the cache buffers, below
        io.bind_output("output", DEVICE)  # bound first: get_outputs()[0]; ORT allocates it
        io.bind_ortvalue_input("past_key", kbuf)
        io.bind_ortvalue_input("past_value", vbuf)
        io.bind_ortvalue_output("present_key", kbuf)
        io.bind_ortvalue_output("present_value", vbuf)
        try:
            sess.run_with_iobinding(io)
        except Exception as e:
            refused = qsl is not None and refusal(["query_seqlens"], e) is not None
            if chunk_may_be_refused and refused:
                continue  # chunk with query_seqlens refused (allowed): go on decoding
            raise
        got = (from_device(io.get_outputs()[0]), from_device(kbuf), from_device(vbuf))
        want = ref.gqa_reference(ref_feeds, attrs, layout)
        masks = ref.defined_masks(ref_feeds, attrs, layout)
        assert_close(got, want, masks, dtype, f"step {step} ({kind}, T={newT.tolist()}): ")
        T = newT


# --------------------------------------------------------------------------------------------
# Invalid inputs: the same validation as the CPU op, so the same messages naming the input
# --------------------------------------------------------------------------------------------
_BASE = GqaCase(batch=2, kind="decode", past_len=5, num_heads=4, kv_num_heads=2, head_size=16,
                dtype="fp16")  # fmt: skip
_A = _BASE.attrs()
F16 = np.float16


def _f(**kw):
    f = dict(_BASE.feeds())
    f.update(kw)
    return f


def _z(*shape):
    return np.zeros(shape, F16)


def _cuda_raise(feeds, attrs, layout, match, shared=False):
    """Creating the CUDA session and running must raise an error matching ``match`` (either at
    session creation or at run)."""
    try:
        sess = cuda_session(build_model(feeds, attrs, KV_DOMAIN, layout), KV_DOMAIN)
        run_cuda(sess, feeds, attrs, shared)
    except NotOnCuda as e:
        pytest.fail(f"expected an error naming {match!r}; instead the node left CUDA: {e}")
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        assert re.search(match, msg), f"error does not match {match!r}: {msg[-500:]}"
        return msg
    pytest.fail(f"no error; expected one matching {match!r}")


BAD = {
    "query_rank2": (_f(query=_z(2, 64)), r"query"),
    "query_hidden": (_f(query=_z(2, 1, 60)), r"query|head_size|hidden"),
    "key_hidden": (_f(key=_z(2, 1, 24), value=_z(2, 1, 24)), r"key|kv_num_heads|head_size"),
    "key_seq": (_f(key=_z(2, 2, 32), value=_z(2, 2, 32)), r"key|sequence"),
    "value_shape": (_f(value=_z(2, 1, 16)), r"value"),
    "past_rank3": (_f(past_key=_z(2, 2, 80), past_value=_z(2, 2, 80)), r"past_key"),
    "past_kv_heads": (_f(past_key=_z(2, 3, 5, 16), past_value=_z(2, 3, 5, 16)), r"past_key"),
    "past_head_size": (_f(past_key=_z(2, 2, 5, 8), past_value=_z(2, 2, 5, 8)), r"past_key"),
    "past_kv_differ": (_f(past_value=_z(2, 2, 7, 16)), r"past_value|past_key"),
    "past_too_short": (_f(past_key=_z(2, 2, 3, 16), past_value=_z(2, 2, 3, 16)),
                       r"past_key|total_sequence_length"),
    "batch_key": (_f(key=_z(3, 1, 32), value=_z(3, 1, 32)), r"batch|key"),
    "batch_past": (_f(past_key=_z(3, 2, 5, 16), past_value=_z(3, 2, 5, 16)), r"batch|past_key"),
    "batch_seqlens": (_f(seqlens_k=np.array([5, 5, 5], np.int32)), r"seqlens_k"),
    "seqlens_rank2": (_f(seqlens_k=np.array([[5], [5]], np.int32)),
                      r"'seqlens_k' must have rank 1, shape \(batch,\) = \(2,\)"),
    "total_two_elems": (_f(total_sequence_length=np.array([6, 6], np.int32)),
                        r"total_sequence_length"),
    "head_sink_len": (_f(head_sink=np.ones(3, F16)), r"head_sink"),
    "bias_last_dim": (_f(attention_bias=np.ones((2, 4, 1, 5), F16)), r"attention_bias"),
    "bias_batch": (_f(attention_bias=np.ones((3, 4, 1, 6), F16)), r"attention_bias"),
    "bias_rank3": (_f(attention_bias=np.ones((4, 1, 6), F16)), r"attention_bias"),
    "key_without_value": (_f(value=None), r"key|value"),
    "rotary_no_caches": (_f(), r"cos_cache|sin_cache"),
    "cos_sin_differ": (_f(cos_cache=np.ones((32, 8), F16), sin_cache=np.ones((33, 8), F16)),
                       r"cos_cache|sin_cache"),
    "cos_too_short": (_f(cos_cache=np.ones((3, 8), F16), sin_cache=np.ones((3, 8), F16)),
                      r"cos_cache|position"),
    "dtype_query_vs_key": (_f(key=_BASE.feeds()["key"].astype(np.float32)), r"key|type"),
    "dtype_query_vs_past": (_f(past_key=_BASE.feeds()["past_key"].astype(np.float32),
                               past_value=_BASE.feeds()["past_value"].astype(np.float32)),
                            r"past_key|past_value|type"),
}  # fmt: skip
_ROTARY_BAD = {"rotary_no_caches", "cos_sin_differ", "cos_too_short"}


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("name", list(BAD))
def test_invalid_inputs_raise(name, layout):
    feeds, match = BAD[name]
    attrs = dict(_A, do_rotary=1) if name in _ROTARY_BAD else _A
    _cuda_raise(feeds, attrs, layout, match)


@pytest.mark.parametrize("layout", [0, 1])
def test_chunk_batch_without_query_seqlens_raises(layout):
    """Chunked prefill with batch 2 and no query_seqlens: refused with the rule (shared
    validation), naming query_seqlens as what makes it valid."""
    c = GqaCase(batch=2, seq=3, kind="chunk", past_len=7, pad=2, num_heads=4, kv_num_heads=2,
                head_size=16, dtype="fp16", kv_layout=layout)  # fmt: skip
    _cuda_raise(c.feeds(), c.attrs(), layout,
                r"chunked prefill.*batch 2.*needs input 'query_seqlens'.*batch must be 1")  # fmt: skip


@pytest.mark.parametrize("layout", [0, 1])
def test_invalid_attributes_raise(layout):
    _cuda_raise(_f(), dict(_A, kv_num_heads=3), layout, r"num_heads|kv_num_heads")
    for bad_layout in (2, -1):
        _cuda_raise(_f(), _A, bad_layout, r"kv_layout")
    # Wrong attribute types (no schema checks a custom op's attributes): the op's own check.
    _cuda_raise(_f(), _A, float(layout), r"attribute 'kv_layout' must be of type INT, got FLOAT")
    _cuda_raise(_f(), dict(_A, scale=1), layout,
                r"attribute 'scale' must be of type FLOAT, got INT")  # fmt: skip


@pytest.mark.skipif(EMULATE, reason="a limit of the CUDA kernels' grid; the CPU op has none")
def test_grid_limit_refused_by_name():
    """batch x kv_num_heads above 65534 (a CUDA grid axis of 65535, one row of which checks the
    lengths) is refused with the rule, not a failed launch; 65534 itself runs."""
    c = GqaCase(batch=16_400, kind="decode", past_len=1, num_heads=4, kv_num_heads=4,
                head_size=8, dtype="fp16", seed=case_seed(33_000))  # fmt: skip
    _cuda_raise(c.feeds(), c.attrs(), 0, r"batch x kv_num_heads = 65600 exceeds 65534")
    c = GqaCase(batch=65_535, kind="decode", past_len=1, num_heads=1, kv_num_heads=1,
                head_size=8, dtype="fp16", seed=case_seed(33_001))  # fmt: skip
    _cuda_raise(c.feeds(), c.attrs(), 1, r"batch x kv_num_heads = 65535 exceeds 65534")
    c = GqaCase(batch=32_767, kind="decode", past_len=1, num_heads=2, kv_num_heads=2,
                head_size=8, dtype="fp16", kv_layout=1, seed=case_seed(33_002))  # fmt: skip
    check_oracle(c, ours(c))


@pytest.mark.parametrize("layout", [0, 1])
def test_shared_total_beyond_capacity_raises(layout):
    """total_sequence_length is a CPU input: checked on the host, as on the CPU op."""
    c = _BASE.replace(shared=True, extra_capacity=2, kv_layout=layout)
    f = dict(c.feeds(), total_sequence_length=np.array(100, np.int32))
    _cuda_raise(f, _A, layout, r"total_sequence_length|capacity|present_key", shared=True)


def test_quantized_and_qk_output_refused():
    f = _f(k_scale=np.ones(1, np.float32), v_scale=np.ones(1, np.float32))
    a = dict(_A, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8)
    _cuda_raise(f, a, 1, r"k_scale|quant")
    with pytest.raises(Exception, match=r"qk_output|output_qk"):
        m = build_model(_f(), dict(_A, qk_output=1), KV_DOMAIN, 1, n_outputs=4)
        sess = cuda_session(m, KV_DOMAIN)
        io = sess.io_binding()
        for k, v in _f().items():
            if v is not None:
                io.bind_cpu_input(k, np.asarray(v))
        for o in ("output", "present_key", "present_value", "output_qk"):
            io.bind_output(o, DEVICE)
        sess.run_with_iobinding(io)


def test_valid_base_runs_after_errors():
    """The base of the error cases is valid and right on CUDA (so the errors are the edits, and
    a failed run leaves the op usable)."""
    for layout in (0, 1):
        c = _BASE.replace(kv_layout=layout)
        check_oracle(c, ours(c))


# --------------------------------------------------------------------------------------------
# Out-of-range device-side lengths: seqlens_k (and position_ids, query_seqlens) live on the GPU,
# so the op cannot check them on the host; they must never crash the process or write outside
# the cache.  Each scenario runs in a child process on a shared fp16 cache bound as a view into
# a larger buffer with guard regions on both sides; afterwards the guards must be intact, the
# cached rows of batch entries with valid lengths unchanged, and the next valid run right.
# --------------------------------------------------------------------------------------------
I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
SEQLENS_SCENARIOS = [
    {"kind": "decode", "bad": {"seqlens_k": [10**6, 8]}},
    {"kind": "decode", "bad": {"seqlens_k": [I32_MAX, 8]}},
    {"kind": "decode", "bad": {"seqlens_k": [-5, 8]}},
    {"kind": "decode", "bad": {"seqlens_k": [I32_MIN, I32_MAX]}, "bad_entries": [0, 1]},
    {"kind": "decode", "bad": {"seqlens_k": [16, 8]}},  # last row of the capacity: valid-ish
    {"kind": "decode", "bad": {"seqlens_k": [17, 8]}},  # one past the capacity
    {"kind": "chunk", "batch": 1, "bad": {"seqlens_k": [10**6]}},
    {"kind": "chunk", "batch": 1, "bad": {"seqlens_k": [1]}},  # T < S: negative past
    {"kind": "chunk", "batch": 1, "bad": {"seqlens_k": [-100]}},
    {"kind": "prompt", "bad": {"seqlens_k": [10**6, 3]}},
    {"kind": "prompt", "bad": {"seqlens_k": [-7, 3]}},
    {"kind": "prompt", "bad": {"seqlens_k": [I32_MAX, I32_MIN]}, "bad_entries": [0, 1]},
]
OTHER_SCENARIOS = [
    {"kind": "decode", "position_ids": True, "bad": {"position_ids": [10**6, 9]}},
    {"kind": "decode", "position_ids": True, "bad": {"position_ids": [-3, 2**62]}},
    {"kind": "chunk", "query_seqlens": True, "bad": {"query_seqlens": [9, 4]}},
    {"kind": "chunk", "query_seqlens": True, "bad": {"query_seqlens": [-1, I32_MAX]},
     "bad_entries": [0, 1]},
    {"kind": "chunk", "query_seqlens": True,
     "bad": {"query_seqlens": [4, 4], "seqlens_k": [10**6, -9]}, "bad_entries": [0, 1]},
]  # fmt: skip
if QUICK:
    SEQLENS_SCENARIOS = SEQLENS_SCENARIOS[::3]
    OTHER_SCENARIOS = OTHER_SCENARIOS[::2]


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("group", ["seqlens_k", "position_ids_query_seqlens"])
def test_out_of_range_lengths_do_not_crash_or_write_out_of_bounds(group, layout):
    scen = SEQLENS_SCENARIOS if group == "seqlens_k" else OTHER_SCENARIOS
    scen = [dict(s, seed=BASE_SEED + i) for i, s in enumerate(scen)]
    rc, recs, out, err = run_robustness_child({"layout": layout, "scenarios": scen})
    started = [ln[6:] for ln in out.splitlines() if ln.startswith("START ")]
    assert rc == 0, (
        f"child process died (rc {rc}) during scenario {started[-1] if started else '?'} "
        f"{seed_note()}\nstdout tail:\n{out[-1500:]}\nstderr tail:\n{err[-3000:]}"
    )
    assert len(recs) == len(scen), f"{len(recs)} results for {len(scen)} scenarios:\n{out[-2000:]}"
    problems = []
    for r in recs:
        sc = r["scenario"]
        if "setup_error" in r:
            if refusal(["query_seqlens"], Exception(r["setup_error"])) is None:
                problems.append(f"{sc}: session creation failed: {r['setup_error']}")
            continue
        if not r["guard_ok"]:
            problems.append(f"{sc}: WROTE OUTSIDE THE CACHE (guard region changed)")
        if not r["valid_entries_untouched"]:
            problems.append(f"{sc}: changed cached rows of valid entries {r['clobbered']}")
        if not r["guard_ok_after_valid"]:
            problems.append(f"{sc}: the valid run wrote outside the cache")
        if not r["invalid_run"].startswith("raised") and not r.get("recorded"):
            problems.append(f"{sc}: the invalid values were neither refused nor recorded")
        refused = refusal(["query_seqlens"], Exception(r["valid_after"])) is not None
        if not refused and not r["valid_after"].startswith("ok"):
            problems.append(f"{sc}: next valid run: {r['valid_after']}")
    summary = "\n".join(
        f"  {r['scenario']['bad']}: {r.get('invalid_run')}; recorded: {r.get('recorded')}"
        for r in recs
    )
    print(f"invalid runs ({group}, layout {layout}):\n{summary}")
    assert not problems, "\n".join(problems) + f"\n{seed_note()}\nall:\n{summary}"


def test_grid_sizes_reported():
    """Not a check of the op: prints the size of each grid (useful in the log)."""
    print(f"core {len(CORE)}, features {len(FEATURE_CASES)}, dispatch {len(DISPATCH_CASES)}, "
          f"vs ORT {len(MS_CASES)}, "
          f"equivalence {len(EQUIV)}; GQA_GPU_SEED={BASE_SEED}; tolerances {GPU_TOLS}")  # fmt: skip
    assert CORE and FEATURE_CASES
