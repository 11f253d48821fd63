"""Quantized KV caches (ORT 1.32's contract: int8 / packed int4, PER_TENSOR / PER_CHANNEL) on
the CPU op, both layouts: the present cache bytes equal ORT's com.microsoft kernel on the same
inputs (layout 1 compared after transposing it to BNSH), the output is within fp16 tolerance of
ORT and of the float64 oracle (tests/helpers/reference_quant.py), and bad quantization inputs get
errors that name the input and the rule (docs/CONTRACT.md section 13)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import pytest
import reference as ref
import reference_quant as rq
from gqa_case import (
    KV_DOMAIN,
    MS_DOMAIN,
    GqaCase,
    build_model,
    gqa_cases,
    make_session,
    next_token_feeds,
    op_available,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto
from quant_harness import placement, run_bound

pytestmark = pytest.mark.skipif(not op_available()[0], reason=op_available()[1])

_ONNX = {
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16,
}


# --------------------------------------------------------------------------------------------
# A quantized case: a GqaCase whose caches hold codes, plus the scales
# --------------------------------------------------------------------------------------------
@dataclass
class QuantCase:
    base: GqaCase
    bits: int = 8
    quant: str = "PER_TENSOR"
    no_past: bool = False  # a first prompt without past inputs (present type from the bit width)

    def __post_init__(self):
        self._feeds = None

    def replace(self, **kw) -> QuantCase:
        return dataclasses.replace(self, **kw)

    @property
    def row(self) -> int:
        return rq.row_elements(self.base.head_size, self.bits)

    @property
    def cache_dtype(self):
        return np.int8 if self.bits == 8 else np.uint8

    def attrs(self) -> dict:
        return dict(
            self.base.attrs(),
            k_quant_type=self.quant,
            v_quant_type=self.quant,
            kv_cache_bit_width=self.bits,
        )

    def scales(self, rng):
        """Scales that keep most values of the case (about N(0, 1)) inside the code range."""
        top = 3.5 / (127.0 if self.bits == 8 else 7.0)
        Nkv, H = self.base.kv_num_heads, self.base.head_size
        if self.quant == "PER_TENSOR":
            return np.array([top], np.float32), np.array([top * 0.8], np.float32)
        k = top * rng.uniform(0.5, 1.5, (1, Nkv, 1, H))
        v = top * rng.uniform(0.5, 1.5, (1, Nkv, 1, H))
        return k.astype(np.float32), v.astype(np.float32)

    def feeds(self) -> dict:
        if self._feeds is not None:
            return self._feeds
        c = self.base
        f = dict(c.feeds())
        rng = np.random.default_rng(c.seed + 7)
        ks, vs = self.scales(rng)
        f["k_scale"], f["v_scale"] = ks, vs
        Nkv, H = c.kv_num_heads, c.head_size
        for name, sc in (("past_key", ks), ("past_value", vs)):
            if f.get(name) is not None:
                logical = ref.from_layout(np.asarray(f[name]).astype(np.float32), c.kv_layout)
                codes = rq.quantize(logical, rq.scale_array(sc, self.quant, Nkv, H), self.bits)
                f[name] = ref.to_layout(codes, c.kv_layout)
            elif not self.no_past:  # ORT types present from past: a zero-capacity past
                f[name] = np.zeros((c.batch, Nkv, 0, self.row), self.cache_dtype)
        self._feeds = f
        return f

    def head_major_feeds(self) -> dict:
        f = dict(self.feeds())
        for name in ("past_key", "past_value"):
            if f.get(name) is not None:
                f[name] = ref.from_layout(f[name], self.base.kv_layout)
        return f

    def reference(self):
        return rq.gqa_quant_reference(self.feeds(), self.attrs(), self.base.kv_layout)

    def masks(self):
        return rq.quant_masks(self.feeds(), self.attrs(), self.base.kv_layout)

    def __repr__(self):
        return f"QuantCase({self.base!r}, bits={self.bits}, quant={self.quant})"


def _model(feeds: dict, attrs: dict, domain: str, layout, cache_dtype) -> bytes:
    m = onnx.load_from_string(build_model(feeds, attrs, domain, layout))
    for o in m.graph.output[1:3]:
        o.type.tensor_type.elem_type = _ONNX[np.dtype(cache_dtype)]
    return m.SerializeToString()


def run(
    qc: QuantCase,
    domain: str = KV_DOMAIN,
    feeds: dict | None = None,
    device: str = "cpu",
    sess=None,
):
    """(output, present_key, present_value) as host arrays after one run on ``device`` ("cpu":
    our CPU op or ORT's; "cuda": the CUDA EP, tests/helpers/quant_harness.py): presents in the
    case's layout for ai.kvlayout, BNSH for com.microsoft. Outputs preallocated (output NaN-filled,
    separate presents filled with 0x5A bytes); shared: past buffers are the presents.
    ``feeds``: instead of the case's (caches in the byte order of ``domain``); ``sess``: this
    session instead of one of the case's model."""
    c = qc.base
    layout = c.kv_layout if domain == KV_DOMAIN else None
    if feeds is None:
        feeds = qc.feeds() if domain == KV_DOMAIN else qc.head_major_feeds()
    place = placement(device)
    if sess is None:
        sess = place.session(_model(feeds, qc.attrs(), domain, layout, qc.cache_dtype), domain)
    got = run_bound(place, sess, feeds, qc.attrs(), c, c.shared, qc.cache_dtype, qc.row)
    return got[:3]


def ort_runs(qc: QuantCase) -> bool:
    """Whether ORT 1.32's CPU kernel runs the case: fp16/fp32 (no bf16 kernel), no q/k norm
    weights (refused on CPU), a past input (it types present), and no sliding window cache whose
    packed row is not a multiple of 16 bytes (ORT refuses it: head_size a multiple of 16 for
    8 bits, 32 for 4 bits; our op runs it)."""
    c = qc.base
    swc_refused = c.sliding_window_cache and qc.row % 16 != 0
    return c.dtype in ("fp16", "fp32") and not c.qk_norm and not qc.no_past and not swc_refused


# FlashAttention's rule, as in gqa_case.check_vs_reference: our error against the oracle at
# most 2x ORT's + a floor; without ORT, an absolute bound of the dtype.
FLOOR = {"fp32": 2e-5, "fp16": 2.5e-4, "bf16": 2e-3}
EPS = {"fp32": 2.0**-23, "fp16": 2.0**-10, "bf16": 2.0**-7}
ALONE = {"fp32": 1e-4, "fp16": 6e-3, "bf16": 4e-2}


def _max_err(got, want, sel) -> float:
    e = np.abs(np.asarray(got).astype(np.float64)[sel] - np.asarray(want)[sel])
    return float(e.max()) if e.size else 0.0


def check_codes(qc: QuantCase, ours, note: str = ""):
    """The presents of ``ours`` (run's triple, on either device) against the oracle's codes:
    equal, except that rotary / norm run in float32 in the kernel and float64 in the oracle, so
    a value at a rounding edge may move one code (on at most 2% of the defined values).
    Returns (oracle output, its defined elements, the presents' defined bytes, the oracle's
    max |output|, ours' max error against it); ``note`` ends the failure messages."""
    c = qc.base
    out_ref, pk_ref, _pv_ref, (pk_lv, pv_lv) = qc.reference()
    rows, pmask = qc.masks()
    osel = np.broadcast_to(rows[:, :, None], out_ref.shape)
    assert ours[1].dtype == qc.cache_dtype and ours[1].shape == pk_ref.shape, (ours[1].shape, qc)
    exact = not c.do_rotary and not c.qk_norm
    for got, lv in ((ours[1], pk_lv), (ours[2], pv_lv)):
        got_lv = rq.unpack(ref.from_layout(got, c.kv_layout), qc.bits, c.head_size)
        defined = ~np.isnan(lv)
        diff = np.abs(got_lv[defined] - lv[defined])
        what = f"codes vs oracle for {qc!r}{note}"
        assert diff.size == 0 or diff.max() <= (0 if exact else 1), what
        assert diff.size == 0 or (diff > 0).mean() <= 0.02, what
    w_max = float(np.abs(out_ref[osel]).max()) if osel.any() else 0.0
    return out_ref, osel, pmask, w_max, _max_err(ours[0], out_ref, osel)


def check(qc: QuantCase) -> None:
    c = qc.base
    ours = run(qc)
    out_ref, osel, pmask, w_max, e_ours = check_codes(qc, ours)
    if ort_runs(qc):
        theirs = run(qc, MS_DOMAIN)
        # The cache bytes: equal to ORT's, in BNSH order.
        pm = ref.from_layout(pmask, c.kv_layout)
        for name, g, t in (
            ("present_key", ours[1], theirs[1]),
            ("present_value", ours[2], theirs[2]),
        ):
            g = ref.from_layout(g, c.kv_layout)
            bad = (g != t) & pm
            assert not bad.any(), (
                f"{name}: {int(bad.sum())} bytes differ from ORT's for {qc!r}; first at "
                f"{np.argwhere(bad)[:3].tolist()}"
            )
        e_ort = _max_err(theirs[0], out_ref, osel)
        # The oracle, written from the contract, agrees with ORT (its codes: through ours).
        alone = ALONE[c.dtype] * max(1.0, w_max)
        assert e_ort <= alone, f"ORT vs oracle: err {e_ort:.3g} > {alone:.3g} for {qc!r}"
        bound = 2.0 * e_ort + FLOOR[c.dtype] + EPS[c.dtype] * w_max
        assert e_ours <= bound, f"output: err {e_ours:.3g} > {bound:.3g} (ORT {e_ort:.3g}) {qc!r}"
    else:
        bound = ALONE[c.dtype] * max(1.0, w_max)
        assert e_ours <= bound, f"output: err {e_ours:.3g} > {bound:.3g} for {qc!r}"


# The sizes of most cases: 4 query heads on 2 KV heads of 16, fp16.
SMALL = {"num_heads": 4, "kv_num_heads": 2, "head_size": 16, "dtype": "fp16"}


# --------------------------------------------------------------------------------------------
# The matrix: layout x bits x granularity x case x shared/separate (fp16)
# --------------------------------------------------------------------------------------------
KINDS = {
    "prompt": {"kind": "prompt", "seq": 7, "batch": 2, "pad": 3},
    "decode": {"kind": "decode", "past_len": 11, "batch": 2, "pad": 4},
    "chunk": {"kind": "chunk", "seq": 5, "past_len": 9, "batch": 1},
}


@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("layout", [0, 1])
def test_matrix(layout, bits, quant, kind, shared):
    seed = 100 * bits + 10 * len(quant) + list(KINDS).index(kind)
    base = GqaCase(**SMALL, kv_layout=layout, shared=shared, seed=seed, **KINDS[kind])
    check(QuantCase(base, bits, quant))


# Head shapes and lengths: MHA / GQA / MQA, head sizes 8 .. 128, a decode past of several
# tiles (key splits), a long prompt (query blocks), packed QKV, batched chunks.
SHAPES = [
    {"num_heads": 2, "kv_num_heads": 2, "head_size": 8, "kind": "decode", "past_len": 1},
    {"num_heads": 8, "kv_num_heads": 1, "head_size": 64, "kind": "decode", "past_len": 300},
    {
        "num_heads": 6,
        "kv_num_heads": 3,
        "head_size": 128,
        "kind": "chunk",
        "seq": 3,
        "past_len": 70,
    },
    {
        "num_heads": 4,
        "kv_num_heads": 2,
        "head_size": 32,
        "kind": "prompt",
        "seq": 90,
        "batch": 2,
        "pad": 17,
    },
    {
        "num_heads": 4,
        "kv_num_heads": 4,
        "head_size": 24,
        "kind": "decode",
        "past_len": 33,
        "packed": True,
    },
    {
        "num_heads": 4,
        "kv_num_heads": 2,
        "head_size": 16,
        "kind": "chunk",
        "seq": 4,
        "past_len": 8,
        "batch": 3,
        "pad": 5,
        "query_seqlens": True,
    },
]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("bits,quant", [(8, "PER_CHANNEL"), (4, "PER_TENSOR")])
@pytest.mark.parametrize("layout", [0, 1])
def test_shapes(layout, bits, quant, shape):
    base = GqaCase(dtype="fp16", kv_layout=layout, seed=shape, **SHAPES[shape])
    check(QuantCase(base, bits, quant))


# Features combined: rotary (half, interleaved, position_ids), window, softcap, sink, smooth
# softmax, attention bias, padding with query_seqlens, extra capacity, a sliding window cache.
FEATURES = {
    "rotary": {"do_rotary": True, "head_size": 32},
    "rotary_interleaved_partial": {
        "do_rotary": True,
        "rotary_interleaved": True,
        "head_size": 32,
        "rotary_dim": 16,
        "position_ids": True,
    },
    "window_softcap": {"local_window_size": 5, "softcap": 2.5},
    "sink_bias": {"head_sink": True, "attention_bias": "bn"},
    "smooth_scale": {"smooth_softmax": 1, "scale": 0.3},
    "rotary_window_softcap_sink": {
        "do_rotary": True,
        "head_size": 32,
        "local_window_size": 4,
        "softcap": 5.0,
        "head_sink": True,
    },
    "query_seqlens_capacity": {"query_seqlens": True, "extra_capacity": 5},
    "sliding_window_cache": {
        "sliding_window_cache": True,
        "local_window_size": 6,
        "extra_capacity": 2,
        "head_size": 32,
    },
    "sliding_window_cache_h16": {"sliding_window_cache": True, "local_window_size": 4},
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("kind", ["prompt", "decode", "chunk"])
@pytest.mark.parametrize("bits,quant", [(8, "PER_TENSOR"), (4, "PER_CHANNEL")])
@pytest.mark.parametrize("layout", [0, 1])
def test_features(layout, bits, quant, kind, feature):
    kw = dict(SMALL, kv_layout=layout, seed=3)
    kw.update(
        {
            "prompt": {"kind": "prompt", "seq": 9, "batch": 2, "pad": 2},
            "decode": {"kind": "decode", "past_len": 13, "batch": 2, "pad": 3},
            "chunk": {
                "kind": "chunk",
                "seq": 4,
                "past_len": 10,
                "batch": 2,
                "pad": 3,
                "query_seqlens": True,
            },
        }[kind]
    )
    kw.update(FEATURES[feature])
    if kw.get("sliding_window_cache"):
        kw["pad"] = 0  # a window-sized cache takes no right-padded prompt
        if kind == "prompt":
            kw["seq"] = 5  # a first prompt that fits the cache
    check(QuantCase(GqaCase(**kw), bits, quant))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_other_dtypes(dtype, bits):
    """fp32 (ORT runs it), bf16 (ORT CPU has no bf16 kernel: the oracle alone)."""
    for layout in (0, 1):
        base = GqaCase(
            **dict(SMALL, dtype=dtype),
            kind="chunk",
            seq=3,
            past_len=6,
            kv_layout=layout,
            do_rotary=True,
        )
        check(QuantCase(base, bits, "PER_CHANNEL"))


def test_qk_norm():
    """q/k norm weights (ORT CPU refuses them): the oracle alone."""
    for layout in (0, 1):
        base = GqaCase(
            num_heads=4,
            kv_num_heads=2,
            head_size=32,
            kind="decode",
            past_len=9,
            dtype="fp16",
            kv_layout=layout,
            do_rotary=True,
            qk_norm=True,
        )
        check(QuantCase(base, 8, "PER_TENSOR"))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("layout", [0, 1])
def test_prompt_without_past(layout, bits):
    """A first prompt without past inputs: present is typed from kv_cache_bit_width."""
    base = GqaCase(**SMALL, kind="prompt", seq=6, kv_layout=layout)
    qc = QuantCase(base, bits, "PER_CHANNEL", no_past=True)
    check(qc)
    # The same bytes as with a zero-capacity past (which ORT needs to type present).
    with_past = run(qc.replace(no_past=False))
    got = run(qc)
    assert np.array_equal(got[1], with_past[1]) and np.array_equal(got[2], with_past[2])


def test_without_present_outputs():
    """A node that names no present outputs (ORT's quantized path requires them; ours keeps the
    cache in a scratch of the cache's bytes): the same output."""
    qc = QuantCase(
        GqaCase(**SMALL, kind="decode", past_len=7, batch=2, pad=2, kv_layout=1), 4, "PER_CHANNEL"
    )
    f = qc.feeds()
    sess = make_session(build_model(f, qc.attrs(), KV_DOMAIN, 1, n_outputs=1), KV_DOMAIN)
    names = {i.name for i in sess.get_inputs()}
    out = sess.run(None, {k: v for k, v in f.items() if v is not None and k in names})[0]
    assert np.array_equal(out, run(qc)[0])


def test_decode_sequence_shared():
    """Token after token into one shared buffer (as onnxruntime-genai binds it): the bytes stay
    ORT's along the way, in both layouts."""
    for bits, layout in ((8, 1), (4, 0), (4, 1)):
        base = GqaCase(
            **SMALL, kind="prompt", seq=5, kv_layout=layout, shared=True, extra_capacity=4, seed=11
        )
        qc = QuantCase(base, bits, "PER_CHANNEL")
        f = qc.feeds()
        ours = run(qc)
        theirs = run(qc, MS_DOMAIN)
        rng = np.random.default_rng(5)
        for step in range(4):
            T = 5 + step + 1
            nf = next_token_feeds(f, rng, T)
            step_case = qc.replace(base=qc.base.replace(kind="decode", past_len=T - 1))
            ours = run(step_case, feeds=dict(nf, past_key=ours[1], past_value=ours[2]))
            theirs = run(step_case, MS_DOMAIN, dict(nf, past_key=theirs[1], past_value=theirs[2]))
            for g, t in ((ours[1], theirs[1]), (ours[2], theirs[2])):
                assert np.array_equal(ref.from_layout(g, layout)[:, :, :T], t[:, :, :T]), step
            assert np.abs(ours[0].astype(np.float64) - theirs[0]).max() < 4e-3


# --------------------------------------------------------------------------------------------
# The code rule itself, at its edges (ties, saturation, NaN / Inf values)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_rounding_and_saturation(bits):
    """Ties round half to even, values beyond the range saturate (int8: -128 is reached), NaN
    goes to the top code, +-Inf to the ends: as ORT."""
    base = GqaCase(num_heads=2, kv_num_heads=1, head_size=16, kind="prompt", seq=3, dtype="fp16")
    qc = QuantCase(base, bits, "PER_TENSOR")
    f = qc.feeds()
    f["k_scale"] = np.array([0.5], np.float32)
    edge = [
        0.25,
        0.75,
        1.25,
        -0.25,
        -0.75,
        -1.25,
        100,
        -100,
        63.5,
        -63.75,
        -64.0,
        -64.25,
        3.75,
        -3.75,
        -4.0,
        -4.25,
    ]
    f["key"][0, 0, :16] = np.array(edge, np.float16)
    f["key"][0, 1, :3] = np.array([np.nan, np.inf, -np.inf], np.float16)
    ours, theirs = run(qc), run(qc, MS_DOMAIN)
    assert np.array_equal(ours[1], theirs[1])
    want = rq.quantize(np.array(edge, np.float32), np.float32(0.5), bits)
    assert np.array_equal(ours[1][0, 0, 0], want)
    top, low = (127, -128) if bits == 8 else (7, -8)
    got = rq.unpack(ours[1][0, 0, 1], bits, 16)
    assert got[:3].tolist() == [top, top, low]


# --------------------------------------------------------------------------------------------
# Property: any valid case of the contract, quantized
# --------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    gqa_cases(dtypes=("fp16", "fp16", "fp32", "bf16")),
    st.sampled_from([8, 4]),
    st.sampled_from(["PER_TENSOR", "PER_CHANNEL"]),
)
def test_property(case, bits, quant):
    check(QuantCase(case, bits, quant))


# --------------------------------------------------------------------------------------------
# Bad inputs: the error names the input or attribute and the rule
# --------------------------------------------------------------------------------------------
_BASE = QuantCase(GqaCase(**SMALL, batch=2, kind="decode", past_len=5), 8, "PER_CHANNEL")
_BASE4 = _BASE.replace(bits=4, quant="PER_TENSOR")


def _raise(qc: QuantCase, feeds=None, attrs=None, match="", input_types=None):
    feeds = dict(qc.feeds()) if feeds is None else feeds
    attrs = qc.attrs() if attrs is None else attrs
    with pytest.raises(Exception, match=match):
        model = build_model(feeds, attrs, KV_DOMAIN, 1, input_types=input_types)
        sess = make_session(model, KV_DOMAIN)
        present = {i.name for i in sess.get_inputs()}
        sess.run(None, {k: v for k, v in feeds.items() if v is not None and k in present})


def _caches(row: int, dtype) -> dict:
    """past_key / past_value of _BASE's sizes with rows of ``row`` elements of ``dtype``."""
    return {
        "past_key": np.zeros((2, 2, 5, row), dtype),
        "past_value": np.zeros((2, 2, 5, row), dtype),
    }


def _with(qc, **kw):
    f = dict(qc.feeds())
    f.update(kw)
    return f


@pytest.mark.parametrize(
    "name,qc,kw,match",
    [
        (
            "count_tensor",
            _BASE4,
            {"k_scale": np.full(2, 0.1, np.float32)},
            r"'k_scale' must hold 1 value .*PER_TENSOR, got shape \(2,\)",
        ),
        (
            "count_channel",
            _BASE,
            {"v_scale": np.full((1, 1, 1, 16), 0.1, np.float32)},
            r"'v_scale' must hold kv_num_heads\*head_size = 32 values",
        ),
        ("zero", _BASE4, {"k_scale": np.zeros(1, np.float32)}, r"'k_scale'\[0\] = 0: .*> 0"),
        ("negative", _BASE4, {"v_scale": np.full(1, -0.1, np.float32)}, r"'v_scale'\[0\] = -0.1"),
        (
            "nan",
            _BASE,
            {
                "k_scale": np.where(np.arange(32) == 3, np.nan, 0.1)
                .astype(np.float32)
                .reshape(1, 2, 1, 16)
            },
            r"'k_scale'\[3\] = nan",
        ),
        ("inf", _BASE4, {"k_scale": np.full(1, np.inf, np.float32)}, r"'k_scale'\[0\] = inf"),
        ("missing_scale", _BASE, {"v_scale": None}, r"'v_scale' is required with v_quant_type"),
        ("missing_both", _BASE, {"k_scale": None, "v_scale": None}, r"'k_scale' is required"),
        (
            "int4_row",
            _BASE4,
            _caches(16, np.uint8),
            r"'past_key' must have shape .*\(head_size \+ 1\) / 2\) = \(2, 2, C, 8\)",
        ),
        (
            "int8_for_bits4",
            _BASE4,
            _caches(8, np.int8),
            r"'past_key' must be uint8 for kv_cache_bit_width=4",
        ),
        (
            "uint8_for_bits8",
            _BASE,
            _caches(16, np.uint8),
            r"'past_key' must be int8 or float8e4m3fn for kv_cache_bit_width=8",
        ),
        (
            "float_cache",
            _BASE,
            _caches(16, np.float16),
            r"'past_key' must be int8 or float8e4m3fn for kv_cache_bit_width=8 .*got float16",
        ),
    ],
)
def test_bad_inputs(name, qc, kw, match):
    _raise(qc, _with(qc, **kw), match=match)


@pytest.mark.parametrize(
    "attrs,match",
    [
        ({"kv_cache_bit_width": 2}, r"'kv_cache_bit_width' must be 8 \(int8 cache\) or 4"),
        ({"kv_cache_bit_width": None}, r"'kv_cache_bit_width' must be 8 .*got 0"),
        (
            {"v_quant_type": "PER_TENSOR"},
            r"'k_quant_type' \(PER_CHANNEL\) and 'v_quant_type' \(PER_TENSOR\) must be equal",
        ),
        ({"k_quant_type": "NONE", "v_quant_type": "NONE"}, r"'kv_cache_bit_width' must be 0"),
        (
            {"k_quant_type": "BOGUS", "v_quant_type": "BOGUS"},
            r"'k_quant_type' must be NONE, PER_TENSOR, PER_CHANNEL or PER_TOKEN .*'BOGUS'",
        ),
    ],
)
def test_bad_attributes(attrs, match):
    _raise(
        _BASE,
        attrs={k: v for k, v in dict(_BASE.attrs(), **attrs).items() if v is not None},
        match=match,
    )


def test_lowercase_quant_type_runs():
    """ORT reads the quant types case-insensitively."""
    qc = _BASE.replace(quant="per_channel")
    want = run(_BASE)
    got = run(qc)
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[0], want[0])


# _BASE without quantization.
_PLAIN = _BASE.base


def test_scale_without_quant_type():
    f = dict(_PLAIN.feeds(), k_scale=np.ones(1, np.float32), v_scale=np.ones(1, np.float32))
    _raise(_BASE, f, _PLAIN.attrs(), r"'k_scale' is given but attribute 'k_quant_type' is NONE")


def test_quantized_cache_without_quant_attributes():
    f = dict(_PLAIN.feeds(), **_caches(16, np.int8))
    _raise(
        _BASE, f, _PLAIN.attrs(), r"'past_key' is int8, a quantized cache: it needs k_quant_type"
    )
