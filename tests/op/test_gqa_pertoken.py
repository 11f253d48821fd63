"""PER_TOKEN scales (ai.kvlayout's calibration-free mode, docs/CONTRACT.md section 14) for int8,
packed int4 and float8e4m3fn caches, and fp8 caches with ORT's static scales (PER_TENSOR /
PER_CHANNEL, section 13), on the CPU op in both layouts.

ORT 1.32's CPU has no PER_TOKEN mode and no fp8 kernel (its schema allows an fp8 cache, but
session creation fails with "Failed to find kernel"), so the oracle alone judges these cases:
tests/helpers/reference_quant.py, written from the contract (numpy, float64 attention; fp8 encoded
from the e4m3fn definition and cross-checked here against ml_dtypes). Checked: the present cache
and scale cache bytes equal the oracle's (codes within one step where rotary or the q/k norm,
float32 in the kernel and float64 in the oracle, moves a value across a rounding edge), the
output within the dtype's tolerance of the oracle, layout 1 equal to layout 0 after permuting,
a shared buffer equal to separate past/present, and errors naming the input and the rule.
"""

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
    GqaCase,
    build_model,
    gqa_cases,
    make_session,
    next_token_feeds,
    op_available,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from quant_harness import host_ortvalue, placement, run_bound

pytestmark = pytest.mark.skipif(not op_available()[0], reason=op_available()[1])

_CACHE = {  # kind -> (numpy storage, ONNX element type)
    "int8": (np.int8, TensorProto.INT8),
    "int4": (np.uint8, TensorProto.UINT8),
    "fp8": (np.uint8, TensorProto.FLOAT8E4M3FN),
}
_SCALE_OUTPUTS = ("present_key_scale", "present_value_scale")


# --------------------------------------------------------------------------------------------
# A case: a GqaCase whose caches hold codes (and, PER_TOKEN, the scale caches)
# --------------------------------------------------------------------------------------------
@dataclass
class PtCase:
    base: GqaCase
    kind: str = "int8"  # int8, int4 (packed in uint8), fp8 (float8e4m3fn)
    quant: str = "PER_TOKEN"  # or PER_TENSOR / PER_CHANNEL (static scales)

    def __post_init__(self):
        self._feeds = None

    def replace(self, **kw) -> PtCase:
        return dataclasses.replace(self, **kw)

    @property
    def per_token(self) -> bool:
        return self.quant.upper() == "PER_TOKEN"

    @property
    def bits(self) -> int:
        return 4 if self.kind == "int4" else 8

    @property
    def row(self) -> int:
        return rq.row_elements(self.base.head_size, self.bits)

    @property
    def np_cache(self):
        return _CACHE[self.kind][0]

    def attrs(self) -> dict:
        return dict(
            self.base.attrs(),
            k_quant_type=self.quant,
            v_quant_type=self.quant,
            kv_cache_bit_width=self.bits,
        )

    def feeds(self) -> dict:
        if self._feeds is not None:
            return self._feeds
        c = self.base
        f = dict(c.feeds())
        B, Nkv, H = c.batch, c.kv_num_heads, c.head_size
        scales = {}
        if not self.per_token:
            rng = np.random.default_rng(c.seed + 7)
            top = 3.5 / rq.QMAX[self.kind]
            shape = (1,) if self.quant == "PER_TENSOR" else (1, Nkv, 1, H)
            for name in ("k_scale", "v_scale"):
                scales[name] = (top * rng.uniform(0.5, 1.5, shape)).astype(np.float32)
                f[name] = scales[name]
        for name, sname, scn in (
            ("past_key", "past_key_scale", "k_scale"),
            ("past_value", "past_value_scale", "v_scale"),
        ):
            if f.get(name) is None:  # a first prompt: a zero-capacity past types present
                f[name] = np.zeros((B, Nkv, 0, self.row), self.np_cache)
                if self.per_token:
                    f[sname] = np.zeros((B, Nkv, 0), np.float32)
                continue
            logical = ref.from_layout(np.asarray(f[name]).astype(np.float32), c.kv_layout)
            if self.per_token:
                sc, el = rq.per_token_encode(logical, self.kind)
                f[sname] = rq.scales_to_layout(sc, c.kv_layout)
            else:
                sa = rq.scale_array(scales[scn], self.quant, Nkv, H)
                el = rq.static_encode(logical, sa, self.kind)
            codes = rq.pack_elements(el, self.kind).astype(self.np_cache)
            f[name] = ref.to_layout(codes, c.kv_layout)
        self._feeds = f
        return f

    def reference(self) -> rq.QuantResult:
        return rq.quant_reference(self.feeds(), self.attrs(), self.base.kv_layout, self.kind)

    def __repr__(self):
        return f"PtCase({self.base!r}, kind={self.kind}, quant={self.quant})"


def model(pc: PtCase, feeds: dict, attrs: dict | None = None, scale_outputs=None) -> bytes:
    """The single-node model: outputs (output, present_key, present_value[, "", scales])."""
    cache_type = _CACHE[pc.kind][1]
    types = {"past_key": cache_type, "past_value": cache_type}
    m = onnx.load_from_string(
        build_model(
            feeds,
            pc.attrs() if attrs is None else attrs,
            KV_DOMAIN,
            pc.base.kv_layout,
            input_types=types,
        )
    )
    outs = _SCALE_OUTPUTS if scale_outputs is None and pc.per_token else (scale_outputs or ())
    node = m.graph.node[0]
    if outs:
        node.output.extend(["", *outs])
        for name in outs:
            m.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return m.SerializeToString()


def run(
    pc: PtCase,
    feeds: dict | None = None,
    shared: bool | None = None,
    device: str = "cpu",
    sess=None,
):
    """(output, present_key, present_value, present_key_scale, present_value_scale) as host
    arrays after one run on ``device`` ("cpu" or "cuda", tests/helpers/quant_harness.py), in the
    case's layout (fp8 caches as uint8; scales None without PER_TOKEN). Outputs preallocated (output
    NaN-filled, separate presents filled with 0x5A bytes and their scale caches with NaN);
    shared: the past buffers (and scale caches) are the presents. ``sess``: this session
    instead of one of the case's model."""
    c = pc.base
    shared = c.shared if shared is None else shared
    feeds = pc.feeds() if feeds is None else feeds
    place = placement(device)
    if sess is None:
        sess = place.session(model(pc, feeds), KV_DOMAIN)
    cache_type = _CACHE[pc.kind][1] if pc.kind == "fp8" else None
    return run_bound(
        place, sess, feeds, pc.attrs(), c, shared, pc.np_cache, pc.row, cache_type, pc.per_token
    )


ALONE = {"fp32": 1e-4, "fp16": 6e-3, "bf16": 4e-2}
# A value rounded to T at an edge moves by one ulp of T, and so may a row's scale (its amax).
SCALE_RTOL = {"fp32": 2e-6, "fp16": 2.0**-10, "bf16": 2.0**-7}


def _steps(codes, kind: str, head_size: int) -> np.ndarray:
    """Stored codes (logical) -> signed steps: adjacent representable values differ by one."""
    el = rq.unpack_elements(codes, kind, head_size)
    return rq.fp8_level(el) if kind == "fp8" else el


def check(pc: PtCase, ours=None) -> None:
    c = pc.base
    ours = run(pc) if ours is None else ours
    r = pc.reference()
    rows, pmask = rq.quant_masks(pc.feeds(), pc.attrs(), c.kv_layout)
    assert ours[1].dtype == pc.np_cache and ours[1].shape == r.present_key.shape, (
        pc,
        ours[1].shape,
    )
    exact = not c.do_rotary and not c.qk_norm
    for got, want, want_el in (
        (ours[1], r.present_key, r.elements_key),
        (ours[2], r.present_value, r.elements_value),
    ):
        if exact:
            bad = (got != want) & pmask
            assert not bad.any(), (
                f"{int(bad.sum())} bytes differ, first {np.argwhere(bad)[:3]} {pc}"
            )
            continue
        got_st = _steps(ref.from_layout(got, c.kv_layout), pc.kind, c.head_size)
        want_el64 = np.nan_to_num(want_el).astype(np.int64)
        want_st = rq.fp8_level(want_el64) if pc.kind == "fp8" else want_el64
        defined = ~np.isnan(want_el)
        diff = np.abs(got_st[defined] - want_st[defined])
        assert diff.size == 0 or diff.max() <= 1, f"codes vs oracle for {pc!r}"
        assert diff.size == 0 or (diff > 0).mean() <= 0.02, f"codes vs oracle for {pc!r}"
    if pc.per_token:
        smask = rq.scale_mask(pc.feeds(), pc.attrs(), c.kv_layout)
        for got, want in ((ours[3], r.present_key_scale), (ours[4], r.present_value_scale)):
            assert got.shape == want.shape, (got.shape, want.shape)
            if exact:
                bad = (got.view(np.uint32) != want.view(np.uint32)) & smask
                assert not bad.any(), f"scales differ at {np.argwhere(bad)[:3]} for {pc!r}"
            else:
                g, w = got[smask].astype(np.float64), want[smask].astype(np.float64)
                assert np.allclose(g, w, rtol=SCALE_RTOL[c.dtype], atol=0, equal_nan=True), pc
    osel = np.broadcast_to(rows[:, :, None], r.output.shape)
    got = np.asarray(ours[0]).astype(np.float64)[osel]
    want = r.output[osel]
    w_max = float(np.abs(want).max()) if want.size else 0.0
    err = float(np.abs(got - want).max()) if want.size else 0.0
    bound = ALONE[c.dtype] * max(1.0, w_max)
    assert err <= bound, f"output: err {err:.3g} > {bound:.3g} for {pc!r}"


SMALL = {"num_heads": 4, "kv_num_heads": 2, "head_size": 16, "dtype": "fp16"}
KINDS = {
    "prompt": {"kind": "prompt", "seq": 7, "batch": 2, "pad": 3},
    "decode": {"kind": "decode", "past_len": 11, "batch": 2, "pad": 4},
    "chunk": {
        "kind": "chunk",
        "seq": 5,
        "past_len": 9,
        "batch": 2,
        "pad": 3,
        "query_seqlens": True,
    },
}
SCHEMES = [
    ("int8", "PER_TOKEN"),
    ("int4", "PER_TOKEN"),
    ("fp8", "PER_TOKEN"),
    ("fp8", "PER_TENSOR"),
    ("fp8", "PER_CHANNEL"),
]


# --------------------------------------------------------------------------------------------
# The matrix: scheme x step x shared/separate x layout (fp16)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared"])
@pytest.mark.parametrize("step", list(KINDS))
@pytest.mark.parametrize("scheme", SCHEMES, ids=["-".join(s) for s in SCHEMES])
@pytest.mark.parametrize("layout", [0, 1])
def test_matrix(layout, scheme, step, shared):
    kind, quant = scheme
    seed = 10 * SCHEMES.index(scheme) + list(KINDS).index(step)
    base = GqaCase(**SMALL, kv_layout=layout, shared=shared, seed=seed, **KINDS[step])
    check(PtCase(base, kind, quant))


# Features combined, and head shapes / lengths (several tiles, key splits, packed QKV, odd H).
FEATURES = {
    "rotary": {"do_rotary": True, "head_size": 32, "position_ids": True},
    "rotary_window_softcap_sink": {
        "do_rotary": True,
        "rotary_interleaved": True,
        "head_size": 32,
        "rotary_dim": 16,
        "local_window_size": 4,
        "softcap": 5.0,
        "head_sink": True,
    },
    "smooth_bias_capacity": {"smooth_softmax": 1, "attention_bias": "bn", "extra_capacity": 5},
    "sliding_window_cache": {
        "sliding_window_cache": True,
        "local_window_size": 6,
        "extra_capacity": 2,
        "pad": 0,
    },
    "qk_norm": {"qk_norm": True, "do_rotary": True, "head_size": 32},
    "long_decode_gqa": {"num_heads": 8, "kv_num_heads": 1, "head_size": 64, "past_len": 300},
    "packed_odd_head": {"num_heads": 4, "kv_num_heads": 4, "head_size": 24, "packed": True},
    "odd_head_size": {"head_size": 9},
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize(
    "scheme",
    [SCHEMES[0], SCHEMES[1], SCHEMES[2], SCHEMES[4]],
    ids=["int8", "int4", "fp8", "fp8-channel"],
)
@pytest.mark.parametrize("layout", [0, 1])
def test_features(layout, scheme, feature):
    kw = dict(
        SMALL,
        kv_layout=layout,
        seed=3,
        kind="chunk",
        seq=4,
        past_len=10,
        batch=2,
        pad=3,
        query_seqlens=True,
        shared=layout == 1,
    )
    kw.update(FEATURES[feature])
    if feature == "long_decode_gqa":
        kw.update(kind="decode", query_seqlens=False)
    check(PtCase(GqaCase(**kw), *scheme))


@pytest.mark.parametrize("step", ["prompt", "decode"])
def test_sliding_window_cache_steps(step):
    """A window-sized cache: the scales move with their rows (shared, in place, and separate)."""
    for layout, shared in ((0, False), (1, True)):
        kw = dict(
            SMALL,
            kv_layout=layout,
            shared=shared,
            sliding_window_cache=True,
            local_window_size=4,
            extra_capacity=1,
            seed=5,
        )
        kw.update(
            {
                "prompt": {"kind": "prompt", "seq": 5},
                "decode": {"kind": "decode", "past_len": 9, "batch": 2, "pad": 2},
            }[step]
        )
        check(PtCase(GqaCase(**kw), "int8"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_other_dtypes(dtype, kind):
    for layout in (0, 1):
        base = GqaCase(
            **dict(SMALL, dtype=dtype),
            kind="chunk",
            seq=3,
            past_len=6,
            kv_layout=layout,
            do_rotary=True,
        )
        check(PtCase(base, kind))
    if kind == "fp8":
        base = GqaCase(**dict(SMALL, dtype=dtype), kind="decode", past_len=6, batch=2, pad=2)
        check(PtCase(base, "fp8", "PER_CHANNEL"))


# --------------------------------------------------------------------------------------------
# Equivalences: layout 1 is layout 0 permuted; a shared buffer is separate past/present
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=["int8", "int4", "fp8"])
def test_layout_equivalence(scheme):
    base = GqaCase(
        **SMALL, kind="chunk", seq=3, past_len=70, do_rotary=True, head_sink=True, seed=8
    )
    r0 = run(PtCase(base, *scheme))
    r1 = run(PtCase(base.replace(kv_layout=1), *scheme))
    for a, b in zip(r0[1:3], r1[1:3], strict=True):
        assert np.array_equal(a, ref.from_layout(b, 1))
    for a, b in zip(r0[3:], r1[3:], strict=True):
        logical = ref.from_layout(b[..., None], 1)[..., 0]
        assert np.array_equal(a.view(np.uint32), logical.view(np.uint32))
    assert np.abs(r0[0].astype(np.float64) - r1[0]).max() <= 2e-3


@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=["int8", "int4", "fp8"])
@pytest.mark.parametrize("layout", [0, 1])
def test_shared_equals_separate(layout, scheme):
    base = GqaCase(
        **SMALL,
        kind="decode",
        past_len=20,
        batch=2,
        pad=5,
        kv_layout=layout,
        extra_capacity=3,
        seed=4,
    )
    pc = PtCase(base, *scheme)
    sep, shr = run(pc, shared=False), run(pc, shared=True)
    T = int(np.asarray(pc.feeds()["total_sequence_length"]))
    assert np.array_equal(sep[0], shr[0])
    smask = rq.scale_mask(pc.feeds(), pc.attrs(), layout)
    _, pmask = rq.quant_masks(pc.feeds(), pc.attrs(), layout)
    for a, b in zip(sep[1:3], shr[1:3], strict=True):
        assert np.array_equal(a[pmask], b[pmask])
    for a, b in zip(sep[3:], shr[3:], strict=True):
        assert np.array_equal(a[smask].view(np.uint32), b[smask].view(np.uint32))
    assert T == 21


def test_decode_sequence_shared():
    """Token after token into one shared buffer and scale cache (as a runtime binds them): the
    cache equals the oracle's along the way."""
    base = GqaCase(
        **SMALL, kind="prompt", seq=5, kv_layout=1, shared=True, extra_capacity=4, seed=11
    )
    pc = PtCase(base, "int8")
    f = dict(pc.feeds())
    ours = run(pc)
    rng = np.random.default_rng(5)
    for step in range(4):
        T = 5 + step + 1
        nf = dict(
            next_token_feeds(f, rng, T),
            past_key=ours[1],
            past_value=ours[2],
            past_key_scale=ours[3],
            past_value_scale=ours[4],
        )
        step_pc = PtCase(base.replace(kind="decode", past_len=T - 1), "int8")
        step_pc._feeds = nf
        ours = run(step_pc, feeds=nf)
        check(step_pc, ours)


# --------------------------------------------------------------------------------------------
# The code rules at their edges
# --------------------------------------------------------------------------------------------
def test_fp8_codec_against_ml_dtypes():
    """The oracle's e4m3fn, written from the definition, against ml_dtypes: every byte decodes
    alike; every float16 value and random float32s (in range: ml_dtypes does not saturate)
    encode alike."""
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = rq.fp8_decode(codes)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32),
            (rng.standard_normal(20000) * np.exp2(rng.uniform(-12, 9, 20000))).astype(np.float32),
            rq.fp8_decode(codes) * np.float32(1.0625),  # midpoints between neighbours: ties
        ]
    )
    x = x[np.isfinite(x) & (np.abs(x) < 464)]
    ml = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    ours = rq.fp8_encode(x)
    assert np.array_equal(ours, ml), x[ours != ml][:5]
    big = np.array([448, 449, 464, 1e6, np.inf, -500, -np.inf, np.nan], np.float32)
    assert rq.fp8_encode(big).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]


def test_fp8_static_codes_bit_exact():
    """fp8 with a static scale of 1: the cache holds fp8(x) for x spanning the whole range
    (subnormals, ties, saturation): the kernel's encoding equals the oracle's bit for bit."""
    base = GqaCase(
        num_heads=1, kv_num_heads=1, head_size=64, kind="prompt", seq=200, dtype="fp32", seed=2
    )
    pc = PtCase(base, "fp8", "PER_TENSOR")
    f = pc.feeds()
    f["k_scale"] = np.ones(1, np.float32)
    rng = np.random.default_rng(1)
    n = 200 * 64
    vals = (rng.standard_normal(n) * np.exp2(rng.uniform(-14, 10, n))).astype(np.float32)
    ties = rq.fp8_decode(np.arange(256, dtype=np.uint8)) * np.float32(1.0625)
    vals[: ties.size] = np.nan_to_num(ties, nan=1.0)
    vals[-4:] = [-0.0, 1e-30, -600.0, 470.0]
    f["key"] = vals.reshape(1, 200, 64)
    ours = run(pc)
    assert np.array_equal(ours[1][0, 0], rq.fp8_encode(vals).reshape(200, 64))
    check(pc, ours)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_per_token_edge_rows(kind):
    """A zero row: scale 0, codes 0, reads 0. A row holding NaN / Inf: scale NaN, codes 0, and
    the queries that attend to it output NaN (as unquantized). Other rows: amax maps to qmax."""
    base = GqaCase(
        num_heads=2, kv_num_heads=1, head_size=16, kind="prompt", seq=4, dtype="fp16", seed=6
    )
    pc = PtCase(base, kind)
    f = pc.feeds()
    f["key"][0, 1] = 0.0
    f["value"][0, 1] = -0.0
    f["key"][0, 2, 3] = np.inf
    f["value"][0, 3, 5] = np.nan
    out, pk, pv, ks, vs = run(pc)
    zero = 0x88 if kind == "int4" else 0
    assert ks[0, 0, 1] == 0 and vs[0, 0, 1] == 0
    assert np.isnan(ks[0, 0, 2]) and np.isnan(vs[0, 0, 3])
    assert np.all(pk[0, 0, 2] == zero) and np.all(pv[0, 0, 3] == zero)
    assert np.all(pk[0, 0, 1] == zero)
    assert not np.isnan(out[0, :2].astype(np.float32)).any()
    assert np.isnan(out[0, 2:].astype(np.float32)).all()
    k0 = f["key"][0, 0].astype(np.float32)
    assert ks[0, 0, 0] == np.float32(np.abs(k0).max()) / np.float32(rq.QMAX[kind])


# --------------------------------------------------------------------------------------------
# Property: any valid case of the contract, PER_TOKEN or fp8
# --------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    gqa_cases(dtypes=("fp16", "fp16", "fp32", "bf16")),
    st.sampled_from(SCHEMES),
)
def test_property(case, scheme):
    check(PtCase(case, *scheme))


# --------------------------------------------------------------------------------------------
# Bad inputs: the error names the input or output and the rule
# --------------------------------------------------------------------------------------------
_BASE = PtCase(GqaCase(**SMALL, batch=2, kind="decode", past_len=5), "int8")


def _raise(pc: PtCase, feeds=None, attrs=None, match="", scale_outputs=None, types=None):
    feeds = dict(pc.feeds()) if feeds is None else feeds
    with pytest.raises(Exception, match=match):
        m = onnx.load_from_string(model(pc, feeds, attrs, scale_outputs))
        for gi in m.graph.input:
            if types and gi.name in types:
                gi.type.tensor_type.elem_type = types[gi.name]
        for go in m.graph.output:  # presents typed as their pasts
            past = go.name.replace("present", "past")
            if types and (go.name in types or past in types):
                go.type.tensor_type.elem_type = types.get(go.name, types.get(past))
        sess = make_session(m.SerializeToString(), KV_DOMAIN)
        names = {i.name for i in sess.get_inputs()}
        ins = {}
        for k, v in feeds.items():
            if v is None or k not in names:
                continue
            t = (types or {}).get(k)
            ins[k] = host_ortvalue(np.ascontiguousarray(v), t) if t else np.asarray(v)
        sess.run(None, ins)


def _with(pc, **kw):
    f = dict(pc.feeds())
    f.update(kw)
    return f


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            {"k_scale": np.ones(1, np.float32)},
            r"'k_scale' must be absent with k_quant_type=PER_TOKEN",
        ),
        ({"past_value_scale": None}, r"'past_value_scale' is required with k_quant_type=PER_TOKEN"),
        # The schema types the scale caches float32: ORT refuses another type, naming the input.
        (
            {"past_key_scale": np.zeros((2, 2, 5), np.float16)},
            r"'tensor\(float16\)' of input parameter \(past_key_scale\)",
        ),
        (
            {"past_key_scale": np.zeros((2, 5), np.float32)},
            r"'past_key_scale' must have shape \(batch, kv_num_heads, capacity\) = \(2, 2, 5\)",
        ),
        ({"past_key_scale": np.zeros((2, 1, 5), np.float32)}, r"'past_key_scale' must have shape"),
        (
            {"past_value_scale": np.zeros((2, 2, 7), np.float32)},
            (
                r"'past_value_scale' has capacity 7: a scale cache must have the capacity of its KV "
                r"cache \('past_value': 5\)"
            ),
        ),
    ],
)
def test_bad_scale_caches(kw, match):
    _raise(_BASE, _with(_BASE, **kw), match=match)


def test_scale_cache_without_per_token():
    pc = _BASE.replace(quant="PER_CHANNEL")
    f = dict(
        _BASE.feeds(),
        k_scale=np.full((1, 2, 1, 16), 0.03, np.float32),
        v_scale=np.full((1, 2, 1, 16), 0.03, np.float32),
    )
    _raise(
        pc,
        f,
        pc.attrs(),
        r"'past_key_scale' is given but k_quant_type is PER_CHANNEL",
        scale_outputs=(),
    )


def test_scale_outputs_rules():
    _raise(
        _BASE,
        match=r"output 'present_key_scale' \(output 4\) is required with "
        r"k_quant_type=PER_TOKEN",
        scale_outputs=(),
    )
    _raise(
        _BASE,
        match=r"output 'present_value_scale' \(output 5\) is required",
        scale_outputs=("present_key_scale",),
    )
    plain = _BASE.replace(quant="PER_CHANNEL")
    f = {k: v for k, v in _BASE.feeds().items() if "scale" not in k}
    f.update(k_scale=np.full(32, 0.03, np.float32), v_scale=np.full(32, 0.03, np.float32))
    _raise(
        plain,
        f,
        plain.attrs(),
        r"output 'present_key_scale' \(output 4\) is named but "
        r"k_quant_type is PER_CHANNEL",
        scale_outputs=_SCALE_OUTPUTS,
    )


def test_per_token_attributes():
    attrs = dict(_BASE.attrs(), v_quant_type="PER_TENSOR")
    _raise(
        _BASE,
        attrs=attrs,
        match=r"'k_quant_type' \(PER_TOKEN\) and 'v_quant_type' "
        r"\(PER_TENSOR\) must be equal",
    )
    attrs = dict(_BASE.attrs(), kv_cache_bit_width=2)
    _raise(_BASE, attrs=attrs, match=r"'kv_cache_bit_width' must be 8 .* or 4")


def test_lowercase_per_token_runs():
    got = run(_BASE.replace(quant="per_token"))
    want = run(_BASE)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_fp8_cache_types():
    fp8 = TensorProto.FLOAT8E4M3FN
    pc = _BASE.replace(kind="fp8")
    f = dict(pc.feeds())
    _raise(
        pc.replace(kind="int4"),
        dict(
            f,
            past_key=np.zeros((2, 2, 5, 16), np.uint8),
            past_value=np.zeros((2, 2, 5, 16), np.uint8),
        ),
        match=r"'past_key' must be uint8 for kv_cache_bit_width=4 .*got float8e4m3fn",
        types={"past_key": fp8, "past_value": fp8},
    )
    _raise(
        pc,
        dict(f, past_value=np.zeros((2, 2, 5, 16), np.int8)),
        match=r"'past_value' must be float8e4m3fn \(the type of 'past_key'\)",
        types={"past_key": fp8, "past_value": TensorProto.INT8, "present_value": fp8},
    )
    plain = _BASE.base
    _raise(
        pc,
        dict(
            plain.feeds(),
            past_key=np.zeros((2, 2, 5, 16), np.uint8),
            past_value=np.zeros((2, 2, 5, 16), np.uint8),
        ),
        plain.attrs(),
        r"'past_key' is float8e4m3fn, a quantized cache: it needs",
        scale_outputs=(),
        types={"past_key": fp8, "past_value": fp8},
    )


def test_scale_sharing_must_follow_the_cache():
    """A scale cache bound in place while its KV cache is separate: refused by name."""
    base = GqaCase(**SMALL, kind="decode", past_len=5, extra_capacity=3, seed=1)
    pc = PtCase(base, "int8")
    f = pc.feeds()
    sess = make_session(model(pc, f), KV_DOMAIN)
    io = sess.io_binding()
    keep = {k: np.array(v, copy=True) for k, v in f.items() if v is not None}
    for k, v in keep.items():
        io.bind_ortvalue_input(k, host_ortvalue(v))
    cap = keep["past_key"].shape[2]
    io.bind_ortvalue_output("output", host_ortvalue(np.zeros((1, 1, 64), np.float16)))
    for name in ("present_key", "present_value"):
        io.bind_ortvalue_output(name, host_ortvalue(np.zeros((1, 2, cap, 16), np.int8)))
    io.bind_ortvalue_output("present_key_scale", host_ortvalue(keep["past_key_scale"]))
    io.bind_ortvalue_output("present_value_scale", host_ortvalue(keep["past_value_scale"]))
    with pytest.raises(Exception, match=r"must share memory exactly when past_key/present_key"):
        sess.run_with_iobinding(io)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_prompt_without_past(kind):
    """A first prompt without past inputs (nor scale caches): present typed from the bit width,
    the same bytes and scales as with a zero-capacity past."""
    pc = PtCase(GqaCase(**SMALL, kind="prompt", seq=6, batch=2, pad=2, kv_layout=1), kind)
    f = {k: v for k, v in pc.feeds().items() if not k.startswith("past_")}
    got, want = run(pc, feeds=f), run(pc)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
