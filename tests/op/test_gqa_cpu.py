"""ai.kvlayout::GroupQueryAttention on CPU vs the float64 oracle, vs ORT's built-in
com.microsoft kernel, and layout 0 vs layout 1 on the same logical case."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from gqa_case import (
    KV_DOMAIN,
    MS_DOMAIN,
    TOLS,
    GqaCase,
    Refused,
    as_f64,
    check_vs_reference,
    compare,
    grid_cases,
    head_major_twin,
    make_session,
    refusal,
    rotary_caches,
    run_session,
)


def ours(case, threads=1):
    """Our op's result; a refusal the contract allows (by name) skips the test, visibly."""
    try:
        return case.run_ours(threads)
    except Refused as e:
        pytest.skip(str(e))


HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
# (kind, S, past): past 0 / 1 / 37 (not a tile multiple); prompt lengths 1 and 17 and 64.
STEPS = [
    ("prompt", 1, 0),
    ("prompt", 17, 0),
    ("prompt", 64, 0),
    ("decode", 1, 1),
    ("decode", 1, 37),
    ("chunk", 5, 1),
    ("chunk", 7, 37),
]


def _grid_fields(i, kind, seq, **_):
    h = (64, 128, 16, 32)[i % 4]
    rot = h % 16 == 0 and i % 3 != 0
    return {
        "batch": 1 if kind == "chunk" else 1 + i % 3,
        "head_size": h,
        "pad": (1 + i % 4) if kind != "chunk" and seq > 4 else (i % 2 if kind == "decode" else 0),
        "extra_capacity": (i % 5) if i % 7 == 0 else 0,
        "do_rotary": rot,
        "rotary_interleaved": bool(i % 5 < 2),
        "rotary_dim": h // 2 if rot and i % 11 == 0 and h >= 32 else 0,
        "seed": 1000 + i,
    }


GRID = grid_cases(
    {"layout": [0, 1], "dtype": ["fp32", "fp16", "bf16"], "heads": HEADS.values(), "step": STEPS},
    _grid_fields,
)


@pytest.mark.parametrize("case", GRID, ids=repr)
def test_op_vs_reference(case):
    check_vs_reference(case, ours(case))


def _ms_comparable(cases):
    return [c for c in cases if c.dtype != "bf16"][::2]


@pytest.mark.parametrize("case", _ms_comparable(GRID), ids=repr)
def test_op_vs_ort_builtin(case):
    """Our op (either layout) vs ORT's head-major kernel on the same logical inputs."""
    mine = ours(case)
    twin = head_major_twin(case)
    theirs = twin.run(MS_DOMAIN)
    rows, pm = twin.masks()
    # Bring our presents to head-major to compare element by element.
    ours_hm = (
        mine[0],
        ref.to_layout(ref.from_layout(as_f64(mine[1]), case.kv_layout), 0),
        ref.to_layout(ref.from_layout(as_f64(mine[2]), case.kv_layout), 0),
    )
    a, r = TOLS[case.dtype]
    # Two low-precision kernels each within ~1 rounding of the oracle: allow twice the budget.
    k = 1 if case.dtype == "fp32" else 2
    compare(twin, ours_hm, theirs, (rows, pm), atol=k * a, rtol=k * r, what="vs ORT: ")


def _layout_pairs():
    out = []
    for i, c in enumerate(GRID[: len(GRID) // 2]):
        if i % 2 == 0:
            out.append(c)
    return out


@pytest.mark.parametrize("case", _layout_pairs(), ids=repr)
def test_layout_equivalence(case):
    """Same logical case in layout 0 and 1: equal output, equal presents after permutation."""
    c0, c1 = case.replace(kv_layout=0), case.replace(kv_layout=1)
    np.testing.assert_array_equal(
        ref.from_layout(as_f64(c0.feeds()["past_key"]), 0)
        if "past_key" in c0.feeds()
        else np.zeros(0),
        ref.from_layout(as_f64(c1.feeds()["past_key"]), 1)
        if "past_key" in c1.feeds()
        else np.zeros(0),
    )
    o0, o1 = ours(c0), ours(c1)
    rows, pm = c0.masks()
    osel = np.broadcast_to(rows[:, :, None], o0[0].shape)
    np.testing.assert_allclose(
        as_f64(o0[0])[osel], as_f64(o1[0])[osel], rtol=1e-6, atol=1e-6, err_msg=repr(case)
    )
    for p0, p1 in ((o0[1], o1[1]), (o0[2], o1[2])):
        assert p0.shape == p1.shape, repr(case)
        l0 = ref.from_layout(as_f64(p0), 0)
        l1 = ref.from_layout(as_f64(p1), 1)
        pm0 = ref.from_layout(pm, 0)
        np.testing.assert_array_equal(l0[pm0], l1[pm0], err_msg=repr(case))


# --------------------------------------------------------------------------------------------
# Features, each in both layouts
# --------------------------------------------------------------------------------------------
FEATURES = {
    "softcap_bias": {"softcap": 1.5, "attention_bias": "bn", "scale": 0.3},
    "bias_b1": {"attention_bias": "b1"},
    "bias_1n": {"attention_bias": "1n"},
    "window1": {"local_window_size": 1},
    "window5": {"local_window_size": 5},
    "smooth": {"smooth_softmax": 1},
    "smooth0": {"smooth_softmax": 0},
    "sink": {"head_sink": True},
    "sink_smooth": {"head_sink": True, "smooth_softmax": 1},
    "rotary_inter": {"do_rotary": True, "rotary_interleaved": True},
    "rotary_partial": {"do_rotary": True, "rotary_dim": 32},
    "position_ids": {"do_rotary": True, "position_ids": True},
    "scale": {"scale": 0.05},
    "qk_norm": {"qk_norm": True},
    "qk_norm_rotary": {"qk_norm": True, "do_rotary": True, "rotary_interleaved": True},
}


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("kind,S,past", [("prompt", 12, 0), ("decode", 1, 23), ("chunk", 6, 23)])
@pytest.mark.parametrize("feature", FEATURES)
def test_features(feature, kind, S, past, layout):
    c = GqaCase(
        batch=1 if kind == "chunk" else 3,
        seq=S,
        kind=kind,
        past_len=past,
        pad=0 if kind == "chunk" else 5,
        num_heads=6,
        kv_num_heads=2,
        head_size=64,
        kv_layout=layout,
        seed=7,
        **FEATURES[feature],
    )
    check_vs_reference(c, ours(c))
    if layout == 0 and not c.qk_norm:  # ORT's CPU refuses q/k norm weights
        compare(c, ours(c), c.run(MS_DOMAIN), what="vs ORT: ")


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("shared", [False, True])
def test_query_seqlens(layout, shared):
    c = GqaCase(batch=3, seq=4, kind="chunk", past_len=9, pad=3, query_seqlens=True,
                kv_layout=layout, shared=shared, extra_capacity=2, do_rotary=True)  # fmt: skip
    check_vs_reference(c, ours(c))


@pytest.mark.parametrize("layout", [0, 1])
def test_causal_zero(layout):
    c = GqaCase(batch=2, seq=7, pad=3, kv_layout=layout, head_size=32)
    f = c.feeds()
    a = dict(c.attrs(), causal=0)
    try:
        got = run_session(make_session(_model(f, a, layout), KV_DOMAIN), f)
    except Exception as e:
        r = refusal(["causal"], e)
        if r is None:
            raise
        pytest.skip(str(r))
    compare(c, got, ref.gqa_reference(f, a, layout))


def _model(feeds, attrs, layout):
    from gqa_case import build_model

    return build_model(feeds, attrs, KV_DOMAIN, layout)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize(
    "kind,S,past,extra,batch,pad",
    [("prompt", 3, 0, 0, 1, 0), ("prompt", 9, 0, 2, 1, 0), ("decode", 1, 3, 0, 1, 0),
     ("decode", 1, 5, 0, 1, 0), ("decode", 1, 11, 3, 1, 0), ("decode", 1, 12, 3, 2, 5),
     ("chunk", 3, 10, 2, 1, 0), ("chunk", 9, 10, 2, 1, 0)],
)  # fmt: skip
def test_sliding_window_cache(layout, shared, kind, S, past, extra, batch, pad):
    c = GqaCase(batch=batch, seq=S, kind=kind, past_len=past, pad=pad, local_window_size=4,
                sliding_window_cache=True, extra_capacity=extra, shared=shared,
                kv_layout=layout)  # fmt: skip
    check_vs_reference(c, ours(c))


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("shared", [False, True])
def test_sliding_window_cache_chunk_over_a_full_window(shared, dtype, layout):
    """A 2-token chunk over a full 128-row window cache (C == W): its live keys (129) outnumber
    the cache's rows, and every one counts (the CUDA plan once counted key splits on C)."""
    c = GqaCase(seq=2, kind="chunk", past_len=300, local_window_size=128, num_heads=8,
                kv_num_heads=2, head_size=64, sliding_window_cache=True, shared=shared,
                dtype=dtype, kv_layout=layout, seed=5)  # fmt: skip
    check_vs_reference(c, ours(c))


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_generation_loop_shared(layout, dtype):
    """A prompt then decode steps on one shared buffer (the onnxruntime-genai flow), step by
    step against the oracle fed with the op's own previous cache."""
    B, N, Nkv, H, C = 2, 4, 2, 64, 24
    rng = np.random.default_rng(3)
    dt = GqaCase(dtype=dtype).np_dtype
    lens = np.array([9, 6])
    base = GqaCase(batch=B, num_heads=N, kv_num_heads=Nkv, head_size=H, dtype=dtype,
                   kv_layout=layout, do_rotary=True, shared=True)  # fmt: skip
    attrs = base.attrs()
    maxp = C + 8
    cos, sin = rotary_caches(H, maxp, dt)
    cache_k = ref.to_layout(rng.standard_normal((B, Nkv, C, H)).astype(dt), layout)
    cache_v = ref.to_layout(rng.standard_normal((B, Nkv, C, H)).astype(dt), layout)
    sess_cache = {}
    for step in range(5):
        S = int(lens.max()) if step == 0 else 1
        T = lens if step == 0 else lens + step
        total = int(T.max())
        f = {
            "query": rng.standard_normal((B, S, (N + 2 * Nkv) * H)).astype(dt),
            "past_key": cache_k,
            "past_value": cache_v,
            "seqlens_k": (T - 1).astype(np.int32),
            "total_sequence_length": np.array(total, np.int32),
            "cos_cache": cos,
            "sin_cache": sin,
        }
        key = S
        if key not in sess_cache:
            sess_cache[key] = make_session(_model(f, attrs, layout), KV_DOMAIN)
        got = run_session(sess_cache[key], f, shared=True, attrs=attrs)
        c = base.replace(seq=S, _feeds=f)
        check_vs_reference(c, got, what=f"step {step}: ")
        cache_k, cache_v = got[1], got[2]


@pytest.mark.parametrize("layout", [0, 1])
def test_deterministic_and_threads(layout):
    c = GqaCase(batch=2, seq=40, pad=7, num_heads=8, kv_num_heads=2, head_size=128,
                kv_layout=layout, do_rotary=True)  # fmt: skip
    a = ours(c, threads=1)
    b = ours(c, threads=2)
    b2 = ours(c, threads=2)
    _rows, _pm = c.masks()
    for x, y, z in zip(a, b, b2, strict=True):
        np.testing.assert_array_equal(y, z)
        assert np.allclose(as_f64(x), as_f64(y), atol=1e-5, equal_nan=True)
    check_vs_reference(c, b)


@pytest.mark.parametrize("layout", [0, 1])
def test_prompt_zero_row_past(layout):
    c = GqaCase(batch=2, seq=5, pad=2, head_size=16, kv_layout=layout)
    f = dict(c.feeds())
    f["past_key"] = np.zeros((2, 2, 0, 16), np.float32)
    f["past_value"] = np.zeros((2, 2, 0, 16), np.float32)
    got = run_session(make_session(_model(f, c.attrs(), layout), KV_DOMAIN), f)
    assert got[1].shape == (2, 2, 5, 16)
    compare(c, got, c.reference())
