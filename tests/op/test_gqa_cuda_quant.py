"""Quantized KV caches (ORT 1.32's contract: int8 / packed int4, PER_TENSOR / PER_CHANNEL) on the
CUDA op, both layouts: the present cache bytes equal our CPU op's (which equal ORT 1.32 CPU's,
tests/op/test_gqa_quant.py) on the same inputs, and ORT CUDA's com.microsoft kernel's where it runs
the case; the output is within fp16 / bf16 tolerance of the float64 oracle
(tests/helpers/reference_quant.py), of our CPU op and of ORT CUDA. Every serving kernel is reached:
the decode kernel's quantized instances (head sizes 64 and 128, one token and chunks), the portable
kernel (prompts, other head sizes, fp32), a sliding window cache; plus a CUDA graph capture of
quantized decode steps and a long (4096-key) decode. Then PER_TOKEN scales (int8, int4, fp8) and
fp8 caches with static scales (ours, sections 13 and 14 of docs/CONTRACT.md): bytes and scale
bits equal our CPU op's, the output within tolerance of the oracle, shared = separate, a 4096-key
decode and a CUDA graph capture of PER_TOKEN decode steps.

Skips without CUDAExecutionProvider or a CUDA build of ort_kvlayout (gpu_util.GPU_MARKS); the
data are fresh per process (GQA_GPU_SEED reproduces them).
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
import reference_quant as rq
from gpu_util import (
    EMULATE,
    GPU_MARKS,
    QUICK,
    case_seed,
    device_filled,
    from_device,
    new_cuda_session,
    seed_note,
    update,
)
from gqa_case import KV_DOMAIN, MS_DOMAIN, GqaCase, rotary_caches
from onnx import TensorProto
from quant_harness import DevicePlace, bind_inputs
from test_gqa_pertoken import SCALE_RTOL as PT_SCALE_RTOL
from test_gqa_pertoken import PtCase
from test_gqa_pertoken import _steps as pt_steps
from test_gqa_pertoken import check as check_pt_oracle
from test_gqa_pertoken import model as pt_model
from test_gqa_pertoken import run as run_pt
from test_gqa_quant import ALONE, EPS, FLOOR, QuantCase, _max_err, _model, check_codes
from test_gqa_quant import run as run_quant

pytestmark = GPU_MARKS


# --------------------------------------------------------------------------------------------
# Running a quantized case on the CUDA EP
# --------------------------------------------------------------------------------------------
def run_cuda_quant(qc: QuantCase, domain: str = KV_DOMAIN, sess=None):
    """(output, present_key, present_value) as host arrays after one run on the CUDA EP
    (test_gqa_quant.run on tests/helpers/quant_harness.py's device placement: inputs on the device,
    total_sequence_length in CPU memory, outputs preallocated, past bound as present when
    shared). ``sess``: this session instead of the cached one of the case's model."""
    return run_quant(qc, domain, device="cuda", sess=sess)


def _exact_codes(qc: QuantCase) -> bool:
    """Whether the key codes must match bit for bit: rotary and norm run in float32 on both
    devices, but not in the same order of operations, so a value at a rounding edge of T can
    round the other way and then move one code (V is never transformed: always exact)."""
    return not qc.base.do_rotary and not qc.base.qk_norm


def assert_same_codes(name, got, want, pmask, exact, what):
    """Present bytes equal on the defined rows (``pmask``, the presents' byte order); with
    rotary / norm, key codes within one code on at most 2% of the defined values."""
    bad = (got != want) & pmask
    if not bad.any():
        return
    if exact or name != "present_key":
        raise AssertionError(
            f"{name}: {int(bad.sum())} bytes differ from {what}; first at "
            f"{np.argwhere(bad)[:3].tolist()} {seed_note()}"
        )
    # One code apart (int8 codes or either nibble of an int4 byte), rarely.
    g, w = got.astype(np.int16), want.astype(np.int16)
    if got.dtype == np.uint8:
        diff = np.maximum(np.abs((g & 15) - (w & 15)), np.abs((g >> 4) - (w >> 4)))
    else:
        diff = np.abs(g - w)
    assert diff[pmask].max() <= 1 and bad.sum() <= 0.02 * pmask.sum(), (
        f"{name}: {int(bad.sum())} bytes differ from {what} (max {int(diff[pmask].max())} codes) "
        f"{seed_note()}"
    )


def check(qc: QuantCase, cpu: bool = True) -> None:
    """Ours on CUDA against the float64 oracle and (``cpu``) our CPU op on the same inputs."""
    c = qc.base
    ours = run_cuda_quant(qc)
    # The codes against the oracle's (as the CPU test: one code at rounding edges with rotary).
    out_ref, osel, pmask, w_max, e_ours = check_codes(qc, ours, f" {seed_note()}")
    bound = ALONE[c.dtype] * max(1.0, w_max)
    assert e_ours <= bound, f"output vs oracle: err {e_ours:.3g} > {bound:.3g} {qc!r} {seed_note()}"
    if cpu:
        theirs = run_quant(qc)
        for name, g, t in (
            ("present_key", ours[1], theirs[1]),
            ("present_value", ours[2], theirs[2]),
        ):
            assert_same_codes(name, g, t, pmask, _exact_codes(qc), f"our CPU op's for {qc!r}")
        e_cpu = _max_err(theirs[0], out_ref, osel)
        # Both against the oracle: ours within 2x the CPU op's error + the fp16 floor (the CPU
        # op dequantizes into float32 tiles; ours converts to T for the MMA, like ORT CUDA).
        bound = 2.0 * e_cpu + FLOOR[c.dtype] + 4 * EPS[c.dtype] * max(1.0, w_max)
        assert e_ours <= max(bound, ALONE[c.dtype] * max(1.0, w_max)), (
            f"output: err {e_ours:.3g} vs CPU op's {e_cpu:.3g} {qc!r} {seed_note()}"
        )


# --------------------------------------------------------------------------------------------
# The matrix: layout x bits x granularity x case x shared/separate x dtype, at head sizes the
# decode kernel serves quantized (64; 128 below) and the portable kernel's (16)
# --------------------------------------------------------------------------------------------
KINDS = {
    "prompt": {"kind": "prompt", "seq": 7, "batch": 2, "pad": 3},
    "decode": {"kind": "decode", "past_len": 37, "batch": 2, "pad": 4},
    "chunk": {
        "kind": "chunk",
        "seq": 3,
        "past_len": 29,
        "batch": 2,
        "pad": 5,
        "query_seqlens": True,
    },
}
HEADS = {"h64": {"num_heads": 8, "kv_num_heads": 2, "head_size": 64},
         "h16": {"num_heads": 4, "kv_num_heads": 2, "head_size": 16}}  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("layout", [0, 1])
def test_matrix(layout, bits, quant, kind, shared, dtype):
    if QUICK and dtype != "fp16":
        pytest.skip("GQA_GPU_QUICK: fp16 only")
    heads = "h64"
    seed = case_seed(1000 + 100 * bits + 10 * len(quant) + list(KINDS).index(kind))
    base = GqaCase(**HEADS[heads], dtype=dtype, kv_layout=layout, shared=shared, seed=seed,
                   **KINDS[kind])  # fmt: skip
    check(QuantCase(base, bits, quant))


# Head shapes: every quantized decode instance (64, 128: one token and chunks; G from 1 to 16),
# the portable kernel (head sizes 8, 32, 96, 256; a prompt of several query blocks; packed QKV),
# fp32, query_seqlens with padding, the tensor-core prefill's quantized instances.
SHAPES = [
    {"num_heads": 16, "kv_num_heads": 1, "head_size": 128, "kind": "decode", "past_len": 300},
    {"num_heads": 8, "kv_num_heads": 8, "head_size": 128, "kind": "chunk", "seq": 5,
     "past_len": 70, "batch": 2, "pad": 9, "query_seqlens": True},
    {"num_heads": 6, "kv_num_heads": 3, "head_size": 64, "kind": "decode", "past_len": 513,
     "batch": 3, "pad": 100, "packed": True},
    {"num_heads": 2, "kv_num_heads": 2, "head_size": 8, "kind": "decode", "past_len": 1},
    {"num_heads": 4, "kv_num_heads": 2, "head_size": 96, "kind": "decode", "past_len": 45},
    {"num_heads": 4, "kv_num_heads": 1, "head_size": 256, "kind": "chunk", "seq": 2,
     "past_len": 33},
    {"num_heads": 4, "kv_num_heads": 2, "head_size": 32, "kind": "prompt", "seq": 90,
     "batch": 2, "pad": 17},
    {"num_heads": 4, "kv_num_heads": 2, "head_size": 64, "kind": "chunk", "seq": 4,
     "past_len": 8, "batch": 3, "pad": 5, "query_seqlens": True},
    # The tensor-core prefill's quantized instances (S >= 16, head sizes 64 and 128).
    {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "kind": "prompt", "seq": 40,
     "batch": 2, "pad": 9, "do_rotary": True},
    {"num_heads": 8, "kv_num_heads": 4, "head_size": 128, "kind": "chunk", "seq": 20,
     "past_len": 50, "batch": 2, "pad": 6, "query_seqlens": True, "local_window_size": 33,
     "softcap": 8.0, "shared": True},
]  # fmt: skip


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("bits,quant", [(8, "PER_CHANNEL"), (4, "PER_TENSOR"), (4, "PER_CHANNEL")])
@pytest.mark.parametrize("layout", [0, 1])
def test_shapes(layout, bits, quant, dtype, shape):
    if QUICK and (2 < shape < len(SHAPES) - 2 or dtype == "fp32"):
        pytest.skip("GQA_GPU_QUICK: the decode kernel's shapes only")
    base = GqaCase(dtype=dtype, kv_layout=layout, seed=case_seed(2000 + shape), **SHAPES[shape])
    check(QuantCase(base, bits, quant))


# Features combined (the decode kernel's full form, the portable kernel, a sliding window cache).
FEATURES = {
    "rotary": {"do_rotary": True},
    "rotary_interleaved_partial_pos": {"do_rotary": True, "rotary_interleaved": True,
                                       "rotary_dim": 32, "position_ids": True},
    "window_softcap": {"local_window_size": 5, "softcap": 2.5},
    "sink_bias": {"head_sink": True, "attention_bias": "bn"},
    "smooth_scale": {"smooth_softmax": 1, "scale": 0.3},
    "rotary_window_softcap_sink": {"do_rotary": True, "local_window_size": 4, "softcap": 5.0,
                                   "head_sink": True},
    "query_seqlens_capacity": {"query_seqlens": True, "extra_capacity": 5},
    "qk_norm_rotary": {"qk_norm": True, "do_rotary": True},
    "sliding_window_cache": {"sliding_window_cache": True, "local_window_size": 6,
                             "extra_capacity": 2},
}  # fmt: skip


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("kind", ["prompt", "decode", "chunk"])
@pytest.mark.parametrize("bits,quant", [(8, "PER_TENSOR"), (4, "PER_CHANNEL")])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("head_size", [64, 32])
def test_features(head_size, layout, bits, quant, kind, feature):
    if QUICK and (head_size != 64 or bits != 8):
        pytest.skip("GQA_GPU_QUICK: head size 64, int8 only")
    kw = {"num_heads": 8, "kv_num_heads": 2, "head_size": head_size, "dtype": "fp16",
          "kv_layout": layout, "seed": case_seed(3000 + list(FEATURES).index(feature))}  # fmt: skip
    kw.update(
        {
            "prompt": {"kind": "prompt", "seq": 9, "batch": 2, "pad": 2},
            "decode": {"kind": "decode", "past_len": 13, "batch": 2, "pad": 3},
            "chunk": {"kind": "chunk", "seq": 2, "past_len": 10, "batch": 2, "pad": 3,
                      "query_seqlens": True},
        }[kind]
    )  # fmt: skip
    kw.update(FEATURES[feature])
    if kw.get("sliding_window_cache"):
        kw["pad"] = 0  # a window-sized cache takes no right-padded prompt
        if kind == "prompt":
            kw["seq"] = 5  # a first prompt that fits the cache
    check(QuantCase(GqaCase(**kw), bits, quant))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("layout", [0, 1])
def test_prompt_without_past(layout, bits):
    """A first prompt without past inputs (present typed from kv_cache_bit_width)."""
    base = GqaCase(num_heads=8, kv_num_heads=2, head_size=64, kind="prompt", seq=6,
                   dtype="fp16", kv_layout=layout, seed=case_seed(4000))  # fmt: skip
    check(QuantCase(base, bits, "PER_CHANNEL", no_past=True))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bits,quant", [(8, "PER_CHANNEL"), (4, "PER_CHANNEL"), (8, "PER_TENSOR")])
@pytest.mark.parametrize("head_size", [128, 64])
def test_long_decode(head_size, bits, quant, dtype):
    """4096 cached keys (many splits of the decode kernel, its merges), both layouts, shared."""
    if QUICK and (dtype != "fp16" or head_size != 128):
        pytest.skip("GQA_GPU_QUICK: fp16 at head size 128 only")
    for layout in (0, 1):
        base = GqaCase(num_heads=8, kv_num_heads=2, head_size=head_size, kind="decode",
                       past_len=4096, batch=2, pad=1000, dtype=dtype, kv_layout=layout,
                       shared=True, do_rotary=True, seed=case_seed(5000 + head_size))  # fmt: skip
        check(QuantCase(base, bits, quant), cpu=not QUICK)


# --------------------------------------------------------------------------------------------
# ORT CUDA's com.microsoft kernel, the second oracle (where it runs the case)
# --------------------------------------------------------------------------------------------
ORT_CASES = {
    "decode_shared_h128": {"num_heads": 16, "kv_num_heads": 2, "head_size": 128, "kind": "decode",
                           "past_len": 100, "batch": 2, "pad": 7, "shared": True},
    "decode_shared_h64": {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "kind": "decode",
                          "past_len": 50, "batch": 2, "pad": 3, "shared": True},
    "chunk_rotary": {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "kind": "chunk",
                     "seq": 3, "past_len": 40, "batch": 2, "pad": 5, "do_rotary": True,
                     "query_seqlens": True, "shared": True},
    "prompt_shared": {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "kind": "prompt",
                      "seq": 20, "batch": 2, "pad": 4, "shared": True},
}  # fmt: skip
# ORT CUDA 1.31.1 runs quantized caches as onnxruntime-genai binds them on CUDA: one buffer
# for past and present. With separate buffers (a decode with past_len 50, or a first prompt) its
# present did not hold the codes (on the H200, 2026-12-06: 12,400 of 12,800 key bytes differ
# from ORT CPU 1.32's, which ours equal) and its prompt output was 0.6 off the dequantizing
# oracle, ours within fp16 tolerance: ORT CUDA is no oracle there, and
# test_separate_buffers_ort_cuda_differs keeps the finding checked.
ORT_SEPARATE = {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "kind": "decode",
                "past_len": 50, "batch": 2, "pad": 3}  # fmt: skip


def _ort_cuda_or_skip(qc: QuantCase):
    try:
        return run_cuda_quant(qc, MS_DOMAIN)
    except Exception as e:  # noqa: BLE001 - ORT CUDA's refusal is the skip's reason
        pytest.skip(f"ORT CUDA's com.microsoft GQA does not run {qc!r}: {str(e)[-300:]}")


@pytest.mark.parametrize("case", list(ORT_CASES))
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bits,quant", [(8, "PER_TENSOR"), (8, "PER_CHANNEL"), (4, "PER_TENSOR"),
                                        (4, "PER_CHANNEL")])  # fmt: skip
@pytest.mark.parametrize("layout", [0, 1])
def test_vs_ort_cuda(layout, bits, quant, dtype, case):
    """The present bytes equal ORT CUDA's (layout 1 compared after transposing to BNSH), the
    outputs within 2x ORT CUDA's own error against the oracle + the fp16 floor. ORT CUDA 1.31.1
    refuses some cases (a uint8 cache where built without int4 support; bf16 on some paths):
    skipped with its message."""
    c = GqaCase(dtype=dtype, kv_layout=layout, seed=case_seed(6000 + len(case)), **ORT_CASES[case])
    qc = QuantCase(c, bits, quant)
    theirs = _ort_cuda_or_skip(qc)
    ours = run_cuda_quant(qc)
    out_ref = qc.reference()[0]
    rows, pmask = qc.masks()
    pm = ref.from_layout(pmask, layout)
    for name, g, t in (("present_key", ours[1], theirs[1]), ("present_value", ours[2], theirs[2])):
        assert_same_codes(name, ref.from_layout(g, layout), t, pm, _exact_codes(qc),
                          f"ORT CUDA's for {qc!r}")  # fmt: skip
    osel = np.broadcast_to(rows[:, :, None], out_ref.shape)
    w_max = float(np.abs(out_ref[osel]).max()) if osel.any() else 0.0
    e_ort, e_ours = _max_err(theirs[0], out_ref, osel), _max_err(ours[0], out_ref, osel)
    bound = 2.0 * e_ort + FLOOR[dtype] + 4 * EPS[dtype] * max(1.0, w_max)
    assert e_ours <= max(bound, ALONE[dtype] * max(1.0, w_max)), (
        f"output: err {e_ours:.3g} vs ORT CUDA's {e_ort:.3g} for {qc!r} {seed_note()}"
    )
    if c.kind == "prompt":
        # ORT CUDA 1.31.1's first prompt attends to the new rows as given, not dequantized (on
        # the H100, 2026-12-06: outputs 0.6 to 0.97 apart, its present bytes equal to ours);
        # ORT CPU 1.32 and ours read them back from the cache (CONTRACT.md §13): ours is held
        # to the oracle above, and only the bytes to ORT CUDA.
        return
    e_between = _max_err(ours[0], theirs[0].astype(np.float64), osel)
    assert e_between <= ALONE[dtype] * max(1.0, w_max), (
        f"output vs ORT CUDA's: {e_between:.3g} for {qc!r} {seed_note()}"
    )


def test_separate_buffers_ort_cuda_differs():
    """The finding behind ORT_CASES' shared buffers: with separate past/present, ORT CUDA
    1.31.1's present codes differ from ours (which equal ORT CPU 1.32's: test_matrix) while
    ours match the oracle. If a later ORT agrees, this fails: move the case back into ORT_CASES."""
    if EMULATE:  # the "ORT CUDA" side is ORT CPU there, which writes the codes
        pytest.skip("ORT CUDA's separate-buffer behaviour: not emulated by ORT CPU")
    c = GqaCase(dtype="fp16", kv_layout=0, seed=case_seed(6100), **ORT_SEPARATE)
    qc = QuantCase(c, 8, "PER_CHANNEL")
    theirs = _ort_cuda_or_skip(qc)
    ours = run_cuda_quant(qc)
    _, pmask = qc.masks()
    differ = int(((ours[1] != theirs[1]) & pmask).sum())
    assert differ > 0, "ORT CUDA now writes the codes of a separate present: compare it again"


# --------------------------------------------------------------------------------------------
# CUDA graph capture of quantized decode steps
# --------------------------------------------------------------------------------------------
class GraphRig:
    """onnxruntime-genai's binding of a decode step: a session (``graph``: captured as a CUDA
    graph on the first run, replayed after) with its inputs on the device, each cache of
    ``caches`` (past names, ``cache_type`` as in bind_inputs) bound as its present too, the
    output preallocated NaN-filled. ``step`` writes new inputs in place and runs once."""

    def __init__(self, model: bytes, feeds: dict, graph: bool, caches, cache_type=None):
        self.sess = new_cuda_session(model, KV_DOMAIN, graph=graph)
        self.io = self.sess.io_binding()
        self.dev = bind_inputs(DevicePlace(), self.sess, self.io, feeds, cache_type)
        self.out = device_filled(np.asarray(feeds["query"]).shape, np.float16)
        self.io.bind_ortvalue_output("output", self.out)
        for k in caches:
            self.io.bind_ortvalue_output(k.replace("past_", "present_"), self.dev[k])
        self.caches = [(k, np.asarray(feeds[k]).dtype) for k in caches]

    def step(self, f: dict):
        """(output, *caches) as host arrays after writing ``f`` into the bound inputs and one
        run (the caches in their feeds' dtypes: fp8 as uint8)."""
        for k, v in f.items():
            update(self.dev[k], v)
        self.sess.run_with_iobinding(self.io)
        return (from_device(self.out), *(from_device(self.dev[k]).view(t) for k, t in self.caches))


def step_feeds(rng, feeds: dict, names, seqlens) -> dict:
    """A decode step's new inputs: random fp16 query / key / value rows (those in ``names``, of
    the feeds' shapes), seqlens_k = ``seqlens`` and the positions there."""
    f = {k: rng.standard_normal(np.asarray(feeds[k]).shape).astype(np.float16)
         for k in ("query", "key", "value") if k in names}  # fmt: skip
    f["seqlens_k"] = seqlens.astype(np.int32)
    if "position_ids" in names:
        f["position_ids"] = seqlens.reshape(-1, 1).astype(np.int64)
    return f


@pytest.mark.parametrize("bits,quant", [(8, "PER_CHANNEL"), (4, "PER_TENSOR")])
@pytest.mark.parametrize("layout", [0, 1])
def test_cuda_graph_decode(layout, bits, quant):
    """onnxruntime-genai's setup: one shared quantized cache bound to past and present, S = 1,
    total_sequence_length = C; ORT captures the first run, later runs replay it while seqlens_k
    grows. Every step's output and cache equal an uncaptured session's fed identically (same
    kernels, same bits), and the cache's codes the CPU op's step by step."""
    B, C, steps = 2, 96, 8 if QUICK else 24
    base = GqaCase(num_heads=8, kv_num_heads=2, head_size=128, kind="decode", past_len=40,
                   batch=B, pad=9, dtype="fp16", kv_layout=layout, shared=True,
                   extra_capacity=C - 41, do_rotary=True, position_ids=True,
                   seed=case_seed(7000 + 10 * bits + layout))  # fmt: skip
    qc = QuantCase(base, bits, quant)
    feeds = {k: v for k, v in qc.feeds().items() if v is not None}
    assert feeds["past_key"].shape[2] == C, feeds["past_key"].shape
    feeds["total_sequence_length"] = np.array(C, np.int32)  # constant: the cache's capacity
    feeds["cos_cache"], feeds["sin_cache"] = rotary_caches(128, C, np.float16)  # every position
    model = _model(feeds, qc.attrs(), KV_DOMAIN, layout, qc.cache_dtype)
    rng = np.random.default_rng(case_seed(7100 + bits))
    names = {i.name for i in new_cuda_session(model, KV_DOMAIN).get_inputs()}
    graph, eager = (GraphRig(model, feeds, g, ("past_key", "past_value")) for g in (True, False))
    seqlens = np.asarray(feeds["seqlens_k"]).copy()
    cpu_cache = {k: np.asarray(feeds[k]).copy() for k in ("past_key", "past_value")}
    for step in range(steps):
        f = step_feeds(rng, feeds, names, seqlens)
        og, kg, vg = graph.step(f)
        oe, ke, ve = eager.step(f)
        what = f"step {step} of {qc!r} {seed_note()}"
        assert np.array_equal(kg, ke) and np.array_equal(vg, ve), f"cache: graph != eager, {what}"
        assert np.array_equal(og.view(np.uint16), oe.view(np.uint16)), f"output differs, {what}"
        # The CPU op on the same step: the same codes (rotary: within one at rounding edges).
        cf = dict(feeds, **f, past_key=cpu_cache["past_key"], past_value=cpu_cache["past_value"])
        cq = qc.replace()
        cq._feeds = cf
        oc, kc, vc = run_quant(cq)
        _, pmask = cq.masks()
        assert_same_codes("present_key", kg, kc, pmask, False, f"our CPU op's, {what}")
        assert_same_codes("present_value", vg, vc, pmask, True, f"our CPU op's, {what}")
        rows, _ = cq.masks()
        osel = np.broadcast_to(rows[:, :, None], oc.shape)
        err = _max_err(og, oc.astype(np.float64), osel)
        assert err <= 6e-3 * max(1.0, float(np.abs(oc[osel]).max())), f"output {err:.3g}, {what}"
        cpu_cache = {"past_key": kg.copy(), "past_value": vg.copy()}
        seqlens += 1


# --------------------------------------------------------------------------------------------
# Bad scales: the CPU op's errors, naming the input and the index
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,index,value,match",
    [
        ("k_scale", 0, 0.0, r"input 'k_scale'\[0\] = 0: every scale must be finite and > 0"),
        ("v_scale", 5, -0.5, r"input 'v_scale'\[5\] = -0.5: every scale must be finite"),
        ("k_scale", 3, np.nan, r"input 'k_scale'\[3\] = nan: every scale must be finite"),
    ],
)
def test_bad_scale_values(name, index, value, match):
    """Checked on the host when a kernel first sees the scale buffers: a fresh session (a cached
    one may have checked good scales at the address the bad ones now take)."""
    base = GqaCase(num_heads=8, kv_num_heads=2, head_size=64, kind="decode", past_len=20,
                   dtype="fp16", seed=case_seed(8000))  # fmt: skip
    qc = QuantCase(base, 8, "PER_CHANNEL")
    f = qc.feeds()
    bad = np.array(f[name], copy=True)
    bad.reshape(-1)[index] = value
    qc._feeds = dict(f, **{name: bad})
    sess = new_cuda_session(_model(f, qc.attrs(), KV_DOMAIN, 0, qc.cache_dtype), KV_DOMAIN)
    with pytest.raises(Exception, match=match):
        run_cuda_quant(qc, sess=sess)
    qc._feeds = f
    run_cuda_quant(qc, sess=sess)  # the same kernel then runs good scales


# --------------------------------------------------------------------------------------------
# PER_TOKEN scales (int8, packed int4, fp8) and fp8 caches with static scales (ours,
# docs/CONTRACT.md sections 13 and 14): the present bytes and the scale caches' bits equal our
# CPU op's on the same inputs, the output within tolerance of the float64 oracle (its `check`,
# tests/op/test_gqa_pertoken.py), shared equal to separate, both layouts; a 4096-key decode and a
# CUDA graph capture of PER_TOKEN decode steps.
# --------------------------------------------------------------------------------------------
_FP8 = TensorProto.FLOAT8E4M3FN
PT_SCHEMES = [("int8", "PER_TOKEN"), ("int4", "PER_TOKEN"), ("fp8", "PER_TOKEN"),
              ("fp8", "PER_TENSOR"), ("fp8", "PER_CHANNEL")]  # fmt: skip
PT_IDS = ["-".join(s).lower() for s in PT_SCHEMES]


def run_cuda_pt(pc: PtCase, sess=None, shared: bool | None = None):
    """(output, present_key, present_value, present_key_scale, present_value_scale) as host
    arrays after one run on the CUDA EP (test_gqa_pertoken.run on tests/helpers/quant_harness.py's
    device placement), in the case's layout (fp8 caches as uint8; scales None without
    PER_TOKEN)."""
    return run_pt(pc, shared=shared, device="cuda", sess=sess)


def assert_same_pt(pc: PtCase, got, want, what: str) -> None:
    """Present bytes and scale bits equal on the defined rows; with rotary / norm (float32 on
    both devices, different operation orders), codes within one step on at most 2% of the
    values and scales within one ulp of T relative (test_gqa_pertoken.py's rule)."""
    c = pc.base
    exact = not c.do_rotary and not c.qk_norm
    _, pmask = rq.quant_masks(pc.feeds(), pc.attrs(), c.kv_layout)
    for name, g, w in (("present_key", got[1], want[1]), ("present_value", got[2], want[2])):
        bad = (g != w) & pmask
        if not bad.any():
            continue
        assert not exact, (
            f"{name}: {int(bad.sum())} bytes differ from {what}; first at "
            f"{np.argwhere(bad)[:3].tolist()} {seed_note()}"
        )
        gs = pt_steps(ref.from_layout(g, c.kv_layout), pc.kind, c.head_size)
        ws = pt_steps(ref.from_layout(w, c.kv_layout), pc.kind, c.head_size)
        m = ref.from_layout(pmask, c.kv_layout)  # bytes -> values: an int4 byte holds two
        m = np.repeat(m, 2, axis=-1)[..., : c.head_size] if pc.kind == "int4" else m
        diff = np.abs(gs.astype(np.int64) - ws.astype(np.int64))[m]
        assert diff.max() <= 1 and (diff > 0).mean() <= 0.02, (
            f"{name}: codes vs {what}: max {int(diff.max())} steps, "
            f"{float((diff > 0).mean()):.3%} differ {seed_note()}"
        )
    if not pc.per_token:
        return
    smask = rq.scale_mask(pc.feeds(), pc.attrs(), c.kv_layout)
    for name, g, w in (("present_key_scale", got[3], want[3]),
                       ("present_value_scale", got[4], want[4])):  # fmt: skip
        bad = (g.view(np.uint32) != w.view(np.uint32)) & smask
        if not bad.any():
            continue
        assert not exact, f"{name}: bits differ at {np.argwhere(bad)[:3].tolist()} {seed_note()}"
        assert np.allclose(g[smask], w[smask], rtol=PT_SCALE_RTOL[c.dtype], atol=0,
                           equal_nan=True), f"{name} vs {what} {seed_note()}"  # fmt: skip


def check_pt(pc: PtCase, cpu: bool = True) -> None:
    """Ours on CUDA against the oracle (codes, scales, output: test_gqa_pertoken.check) and
    (``cpu``) our CPU op's bytes and scale bits on the same inputs."""
    ours = run_cuda_pt(pc)
    check_pt_oracle(pc, ours)
    if cpu:
        assert_same_pt(pc, ours, run_pt(pc), f"our CPU op's for {pc!r}")


PT_HEADS = {"h64": {"num_heads": 8, "kv_num_heads": 2, "head_size": 64},
            "h128": {"num_heads": 8, "kv_num_heads": 1, "head_size": 128},
            "h16": {"num_heads": 4, "kv_num_heads": 2, "head_size": 16}}  # fmt: skip


@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("heads", list(PT_HEADS))
@pytest.mark.parametrize("scheme", PT_SCHEMES, ids=PT_IDS)
@pytest.mark.parametrize("layout", [0, 1])
def test_pt_matrix(layout, scheme, heads, kind, shared):
    """Every scheme x step x kernel (decode kernel: head sizes 64 / 128; portable: 16)."""
    if QUICK and heads == "h16":
        pytest.skip("GQA_GPU_QUICK: the decode kernel's head sizes only")
    seed = case_seed(9000 + 100 * PT_SCHEMES.index(scheme) + 10 * list(KINDS).index(kind))
    base = GqaCase(**PT_HEADS[heads], dtype="fp16", kv_layout=layout, shared=shared, seed=seed,
                   **KINDS[kind])  # fmt: skip
    check_pt(PtCase(base, *scheme))


PT_FEATURES = {
    "rotary": {"do_rotary": True, "position_ids": True},
    "rotary_window_softcap_sink": {"do_rotary": True, "rotary_interleaved": True,
                                   "rotary_dim": 32, "local_window_size": 4, "softcap": 5.0,
                                   "head_sink": True},
    "smooth_bias_capacity": {"smooth_softmax": 1, "attention_bias": "bn", "extra_capacity": 5},
    "qk_norm_rotary": {"qk_norm": True, "do_rotary": True},
    "sliding_window_cache": {"sliding_window_cache": True, "local_window_size": 6,
                             "extra_capacity": 2, "pad": 0},
}  # fmt: skip


@pytest.mark.parametrize("feature", list(PT_FEATURES))
@pytest.mark.parametrize("kind", ["decode", "chunk"])
@pytest.mark.parametrize("scheme", PT_SCHEMES[:3] + PT_SCHEMES[4:], ids=PT_IDS[:3] + PT_IDS[4:])
@pytest.mark.parametrize("layout", [0, 1])
def test_pt_features(layout, scheme, kind, feature):
    if QUICK and scheme[0] == "int4":
        pytest.skip("GQA_GPU_QUICK: int8 and fp8")
    kw = {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "dtype": "fp16",
          "kv_layout": layout, "shared": layout == 1,
          "seed": case_seed(9500 + list(PT_FEATURES).index(feature))}  # fmt: skip
    kw.update({"decode": {"kind": "decode", "past_len": 13, "batch": 2, "pad": 3},
               "chunk": {"kind": "chunk", "seq": 3, "past_len": 10, "batch": 2, "pad": 3,
                         "query_seqlens": True}}[kind])  # fmt: skip
    kw.update(PT_FEATURES[feature])
    check_pt(PtCase(GqaCase(**kw), *scheme))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("scheme", PT_SCHEMES[:3] + PT_SCHEMES[3:4], ids=PT_IDS[:4])
@pytest.mark.parametrize("layout", [0, 1])
def test_pt_dtypes(layout, scheme, dtype):
    """bf16 (the decode kernel's bf16 instances, a prompt on the portable kernel) and fp32."""
    for kind in ("decode", "prompt"):
        base = GqaCase(**PT_HEADS["h64"], dtype=dtype, kv_layout=layout, do_rotary=True,
                       seed=case_seed(9700 + len(dtype)), **KINDS[kind])  # fmt: skip
        check_pt(PtCase(base, *scheme))


@pytest.mark.parametrize("scheme", PT_SCHEMES, ids=PT_IDS)
@pytest.mark.parametrize("layout", [0, 1])
def test_pt_shared_equals_separate(layout, scheme):
    """A shared buffer (and scale cache) gives the separate run's output, bytes and scale bits."""
    base = GqaCase(**PT_HEADS["h64"], dtype="fp16", kind="chunk", seq=2, past_len=40, query_seqlens=True, batch=2,
                   pad=5, kv_layout=layout, extra_capacity=3, seed=case_seed(9800))  # fmt: skip
    pc = PtCase(base, *scheme)
    sep, shr = run_cuda_pt(pc, shared=False), run_cuda_pt(pc, shared=True)
    assert np.array_equal(sep[0].view(np.uint16), shr[0].view(np.uint16)), seed_note()
    _, pmask = rq.quant_masks(pc.feeds(), pc.attrs(), layout)
    for a, b in zip(sep[1:3], shr[1:3], strict=True):
        assert np.array_equal(a[pmask], b[pmask]), seed_note()
    if pc.per_token:
        smask = rq.scale_mask(pc.feeds(), pc.attrs(), layout)
        for a, b in zip(sep[3:], shr[3:], strict=True):
            assert np.array_equal(a[smask].view(np.uint32), b[smask].view(np.uint32)), seed_note()


@pytest.mark.parametrize("scheme", PT_SCHEMES[:4], ids=PT_IDS[:4])
@pytest.mark.parametrize("head_size", [128, 64])
def test_pt_long_decode(head_size, scheme):
    """4096 cached keys (many splits of the decode kernel, its merges), both layouts, shared."""
    if QUICK and head_size != 128:
        pytest.skip("GQA_GPU_QUICK: head size 128 only")
    for layout in (0, 1):
        base = GqaCase(num_heads=8, kv_num_heads=2, head_size=head_size, kind="decode",
                       past_len=4096, batch=2, pad=1000, dtype="fp16", kv_layout=layout,
                       shared=True, do_rotary=True, seed=case_seed(9900 + head_size))  # fmt: skip
        check_pt(PtCase(base, *scheme), cpu=not QUICK)


@pytest.mark.parametrize(
    "scheme", [("int8", "PER_TOKEN"), ("fp8", "PER_TOKEN")], ids=["int8", "fp8"]
)
@pytest.mark.parametrize("layout", [0, 1])
def test_pt_cuda_graph_decode(layout, scheme):
    """A captured PER_TOKEN decode step (onnxruntime-genai's setup: one shared cache and scale
    cache bound as past and present, S = 1, total_sequence_length = C): every replayed step's
    output, cache bytes and scale bits equal an uncaptured session's fed identically, and the
    cache and scales our CPU op's step by step."""
    B, C, steps = 2, 96, 6 if QUICK else 16
    base = GqaCase(num_heads=8, kv_num_heads=2, head_size=128, kind="decode", past_len=40,
                   batch=B, pad=9, dtype="fp16", kv_layout=layout, shared=True,
                   extra_capacity=C - 41, do_rotary=True, position_ids=True,
                   seed=case_seed(9950 + layout))  # fmt: skip
    pc = PtCase(base, *scheme)
    feeds = {k: v for k, v in pc.feeds().items() if v is not None}
    assert feeds["past_key"].shape[2] == C, feeds["past_key"].shape
    feeds["total_sequence_length"] = np.array(C, np.int32)
    feeds["cos_cache"], feeds["sin_cache"] = rotary_caches(128, C, np.float16)
    pc._feeds = feeds
    model = pt_model(pc, feeds)
    rng = np.random.default_rng(case_seed(9960))
    names = {i.name for i in new_cuda_session(model, KV_DOMAIN).get_inputs()}
    caches = ("past_key", "past_value", "past_key_scale", "past_value_scale")
    cache_type = _FP8 if pc.kind == "fp8" else None
    graph, eager = (GraphRig(model, feeds, g, caches, cache_type) for g in (True, False))
    seqlens = np.asarray(feeds["seqlens_k"]).copy()
    state = {k: np.asarray(feeds[k]).copy() for k in caches}
    for step in range(steps):
        f = step_feeds(rng, feeds, names, seqlens)
        g, e = graph.step(f), eager.step(f)
        what = f"step {step} of {pc!r} {seed_note()}"
        for a, b in zip(g[1:], e[1:], strict=True):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (
                f"cache: graph != eager, {what}"
            )
        assert np.array_equal(g[0].view(np.uint16), e[0].view(np.uint16)), f"output, {what}"
        cq = pc.replace()
        cq._feeds = dict(feeds, **f, **state)
        want = run_pt(cq)
        assert_same_pt(cq, g, want, f"our CPU op's, {what}")
        rows, _ = rq.quant_masks(cq.feeds(), cq.attrs(), layout)
        osel = np.broadcast_to(rows[:, :, None], want[0].shape)
        err = _max_err(g[0], want[0].astype(np.float64), osel)
        assert err <= 6e-3 * max(1.0, float(np.abs(want[0][osel]).max())), (
            f"output {err:.3g}, {what}"
        )
        state = {k: a.copy() for k, a in zip(caches, g[1:], strict=True)}
        seqlens += 1
