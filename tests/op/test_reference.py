"""The float64 oracle (reference.py) vs onnxruntime 1.32's built-in CPU
com.microsoft::GroupQueryAttention, and the experiments behind docs/CONTRACT.md.

These tests need only onnxruntime; they prove the oracle that the op tests rely on."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import reference as ref
from gqa_case import (
    MS_DOMAIN,
    GqaCase,
    build_model,
    compare,
    gqa_cases,
    grid_cases,
    make_session,
    run_session,
)
from hypothesis import HealthCheck, given, note, settings


def _run_ms(feeds, attrs, shared=False):
    return run_session(make_session(build_model(feeds, attrs, MS_DOMAIN)), feeds, shared)


# --------------------------------------------------------------------------------------------
# Layout arithmetic
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [0, 1])
def test_layout_addresses(layout):
    B, Nkv, C, H = 2, 3, 5, 4
    logical = np.arange(B * Nkv * C * H, dtype=np.float64).reshape(B, Nkv, C, H) + 0.5
    buf = ref.to_layout(logical, layout)
    assert buf.shape == (B, Nkv, C, H)
    flat = buf.reshape(-1)
    for b, h, s, d in itertools.product(range(B), range(Nkv), range(C), range(H)):
        if layout == 0:
            addr = b * Nkv * C * H + h * C * H + s * H + d
        else:
            addr = b * C * Nkv * H + s * Nkv * H + h * H + d
        assert flat[addr] == logical[b, h, s, d]
    np.testing.assert_array_equal(ref.from_layout(buf, layout), logical)


def test_layout1_token_address_independent_of_capacity():
    # Growing C in BSNH does not move token t of batch 0.
    for C in (4, 9):
        st = ref.kv_strides(1, 1, 2, C, 8)
        assert st[2] == 2 * 8 and st[1] == 8


def test_bad_layout_rejected():
    with pytest.raises(ValueError, match="kv_layout"):
        ref.kv_strides(2, 1, 1, 1, 1)


@pytest.mark.parametrize("C,W", [(4, 4), (7, 4), (6, 4), (16, 1)])
def test_sliding_window_resident_bounds(C, W):
    for T in range(60):
        L = ref.sliding_window_resident(T, C, W)
        assert min(T, W) <= L <= min(T, C)
        if T <= C:
            assert L == T


# --------------------------------------------------------------------------------------------
# Oracle vs ORT over a grid of cases
# --------------------------------------------------------------------------------------------
def _grid_fields(i, kind, **_):
    h = (16, 32, 64, 128)[i % 4]
    return {
        "batch": 1 if kind == "chunk" else 1 + i % 3,
        "head_size": h,
        "pad": (i % 3) if kind != "chunk" else 0,
        "do_rotary": bool(i % 5 < 3),
        "rotary_interleaved": bool(i % 7 < 3),
        "rotary_dim": h // 2 if i % 11 == 0 and h >= 32 else 0,
        "seed": i,
    }


def _grid():
    steps = [("prompt", 1, 0), ("prompt", 17, 0), ("decode", 1, 1), ("decode", 1, 37),
             ("chunk", 5, 37), ("chunk", 3, 1)]  # fmt: skip
    axes = {"heads": [(4, 4), (8, 2), (4, 1)], "step": steps, "dtype": ["fp32", "fp16"]}
    return grid_cases(axes, _grid_fields)


@pytest.mark.parametrize("case", _grid(), ids=repr)
def test_reference_matches_ort(case):
    compare(case, case.run(MS_DOMAIN), case.reference())


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=gqa_cases(dtypes=("fp32",), layouts=(0,), qk_norm=False))
def test_reference_matches_ort_property(case):
    """Any valid case ORT's CPU kernel runs (fp32, head-major) matches the oracle."""
    note(repr(case))
    compare(case, case.run(MS_DOMAIN), case.reference())


# --------------------------------------------------------------------------------------------
# Contract experiments (docs/CONTRACT.md cites these by name)
# --------------------------------------------------------------------------------------------
def _check(case, **kw):
    compare(case, case.run(MS_DOMAIN), case.reference(), **kw)


def test_prompt_padding():
    _check(GqaCase(batch=3, seq=9, pad=4, num_heads=4, kv_num_heads=2, head_size=32))


def test_decode_ragged():
    _check(GqaCase(batch=3, kind="decode", past_len=20, pad=7, head_size=32))


def test_chunk():
    _check(GqaCase(batch=1, seq=6, kind="chunk", past_len=11, head_size=32, do_rotary=True))


def test_query_seqlens():
    _check(GqaCase(batch=3, seq=4, kind="chunk", past_len=9, pad=3, query_seqlens=True))
    # Q = 0: an idle entry keeps its cache; its output rows are unspecified.
    c = GqaCase(batch=2, seq=3, kind="chunk", past_len=6, query_seqlens=True, head_size=16)
    f = dict(c.feeds())
    f["query_seqlens"] = np.array([3, 0], np.int32)
    f["seqlens_k"] = np.array([8, 5], np.int32)
    got = _run_ms(f, c.attrs())
    want = ref.gqa_reference(f, c.attrs(), 0)
    compare(c, got, want, masks=ref.defined_masks(f, c.attrs(), 0))


def test_present_capacity():
    # Unshared past longer than total ("static cache"): C' = C.
    c = GqaCase(batch=2, kind="decode", past_len=5, pad=2, extra_capacity=3, head_size=16)
    got = c.run(MS_DOMAIN)
    assert got[1].shape[2] == c.feeds()["past_key"].shape[2] == 9
    compare(c, got, c.reference())
    # Dynamic cache: C' = total.
    c = GqaCase(batch=2, kind="decode", past_len=5, pad=2, head_size=16)
    assert c.run(MS_DOMAIN)[1].shape[2] == 6
    # First prompt with a zero-row past.
    c = GqaCase(batch=2, seq=5, pad=2, head_size=16)
    f = dict(c.feeds())
    f["past_key"] = np.zeros((2, 2, 0, 16), np.float32)
    f["past_value"] = np.zeros((2, 2, 0, 16), np.float32)
    got = _run_ms(f, c.attrs())
    assert got[1].shape == (2, 2, 5, 16)
    compare(c, got, c.reference())


def test_unspecified_regions_documented():
    """What ORT's CPU puts where the contract is silent (documented, never required)."""
    c = GqaCase(batch=2, seq=6, pad=3, num_heads=2, kv_num_heads=1, head_size=16, do_rotary=True)
    f = c.feeds()
    out, pk, pv = c.run(MS_DOMAIN)
    # Padded prompt rows attend keys [0, T_b) (not [0, s]).
    full = ref.gqa_reference(dict(f, seqlens_k=np.array([5, 5], np.int32)), c.attrs(), 0)
    assert not np.allclose(out[1, 3:], full[0][1, 3:], atol=1e-3)
    # All S new K/V rows are written on a prompt (padding rows rotated at position s).
    np.testing.assert_array_equal(pv[1, 0], f["value"].reshape(2, 6, 16)[1])
    # Non-shared decode: rows >= T_b are zero-filled.
    c = GqaCase(batch=2, kind="decode", past_len=5, pad=2, head_size=16)
    _, pk, _ = c.run(MS_DOMAIN)
    assert np.all(pk[1, :, 4:] == 0)


def test_shared_equals_unshared():
    c = GqaCase(batch=2, kind="decode", past_len=9, pad=3, extra_capacity=4, head_size=32)
    s = c.replace(shared=True)
    a, b = c.run(MS_DOMAIN), s.run(MS_DOMAIN)
    _rows, pm = c.masks()
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(a[1][pm], b[1][pm])
    # Shared: rows >= T_b are not written.
    f = s.feeds()
    np.testing.assert_array_equal(b[1][1, :, 7:], f["past_key"][1, :, 7:])
    compare(s, b, s.reference())


def _sensitive(case, variant):
    """The case matches the oracle and not the rejected alternative reading."""
    got = case.run(MS_DOMAIN)
    compare(case, got, case.reference())
    alt = ref.gqa_reference(case.ref_inputs(), case.attrs(), 0, variant=frozenset([variant]))
    with pytest.raises(AssertionError):
        compare(case, got, alt)


def test_softcap_then_bias():
    c = GqaCase(batch=2, kind="decode", past_len=7, pad=3, softcap=1.5, attention_bias="bn")
    _sensitive(c.replace(scale=0.5), "bias_before_softcap")


@pytest.mark.parametrize("shape", ["bn", "b1", "1n", "11"])
def test_bias_shapes(shape):
    _check(GqaCase(batch=2, seq=5, pad=2, attention_bias=shape, head_size=16))
    _check(GqaCase(batch=2, kind="decode", past_len=6, pad=2, attention_bias=shape))


@pytest.mark.parametrize("W", [1, 4, 100])
def test_window(W):
    c = GqaCase(batch=2, kind="decode", past_len=9, pad=3, local_window_size=W)
    if W < 9:
        _sensitive(c, "window_plus_one")
    else:
        _check(c)
    _check(GqaCase(batch=2, seq=9, pad=3, local_window_size=W))
    _check(GqaCase(batch=1, seq=4, kind="chunk", past_len=9, local_window_size=W))


def test_window_zero_and_negative():
    c = GqaCase(batch=1, kind="decode", past_len=5, head_size=16)
    out = _run_ms(c.feeds(), dict(c.attrs(), local_window_size=0))[0]
    assert np.all(out == 0)
    out = _run_ms(c.feeds(), dict(c.attrs(), local_window_size=-2))[0]
    np.testing.assert_allclose(out, c.reference()[0], atol=1e-5)


@pytest.mark.parametrize("smooth", [-1, 0, 1])
@pytest.mark.parametrize("sink", [False, True])
def test_smooth_and_sink(smooth, sink):
    _check(
        GqaCase(batch=2, kind="decode", past_len=7, pad=3, smooth_softmax=smooth, head_sink=sink)
    )
    _check(GqaCase(batch=2, seq=6, pad=3, smooth_softmax=smooth, head_sink=sink, head_size=16))


def test_causal_zero():
    c = GqaCase(batch=2, seq=5, pad=2, head_size=16)
    f = c.feeds()
    a = dict(c.attrs(), causal=0)
    compare(c, _run_ms(f, a), ref.gqa_reference(f, a, 0))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [0, 16, 32])
def test_rotary(interleaved, rd):
    for kind, s, past in (("prompt", 7, 0), ("decode", 1, 9), ("chunk", 4, 9)):
        _check(GqaCase(batch=1 if kind == "chunk" else 2, seq=s, kind=kind, past_len=past,
                       head_size=64, do_rotary=True, rotary_interleaved=interleaved,
                       rotary_dim=rd, pad=0 if kind == "chunk" else 2))  # fmt: skip


def test_position_ids():
    # Decode: position_ids[b, s] used as given.
    c = GqaCase(batch=2, kind="decode", past_len=5, head_size=16, do_rotary=True)
    f = dict(c.feeds(), position_ids=np.array([[17], [2]], np.int64))
    compare(c, _run_ms(f, c.attrs()), ref.gqa_reference(f, c.attrs(), 0))
    # First prompt: only position_ids[0, 0] counts, for every entry.
    c = GqaCase(batch=2, seq=4, head_size=16, do_rotary=True, kv_num_heads=1, num_heads=2)
    f = dict(c.feeds(), position_ids=np.array([[3, 9, 1, 0], [10, 11, 12, 13]], np.int64))
    got = _run_ms(f, c.attrs())
    compare(c, got, ref.gqa_reference(f, c.attrs(), 0))
    alt = ref.gqa_reference(f, c.attrs(), 0, variant=frozenset(["position_ids_per_entry"]))
    with pytest.raises(AssertionError):
        compare(c, got, alt)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize(
    "kind,S,past,extra,batch,pad",
    [("prompt", 3, 0, 0, 1, 0), ("prompt", 9, 0, 2, 1, 0), ("prompt", 9, 0, 1, 2, 0),
     ("decode", 1, 3, 0, 1, 0), ("decode", 1, 5, 0, 1, 0), ("decode", 1, 9, 3, 1, 0),
     ("decode", 1, 11, 3, 1, 0), ("decode", 1, 12, 3, 2, 5), ("chunk", 3, 10, 2, 1, 0),
     ("chunk", 9, 10, 2, 1, 0)],
)  # fmt: skip
def test_sliding_window_cache(shared, kind, S, past, extra, batch, pad):
    _check(GqaCase(batch=batch, seq=S, kind=kind, past_len=past, pad=pad, local_window_size=4,
                   sliding_window_cache=True, extra_capacity=extra, shared=shared))  # fmt: skip


def test_sliding_window_cache_chunks_with_options():
    base = GqaCase(batch=2, seq=3, kind="chunk", past_len=12, pad=5, local_window_size=4,
                   sliding_window_cache=True, extra_capacity=3, query_seqlens=True)  # fmt: skip
    _check(base)
    _check(base.replace(attention_bias="bn"))
    _check(base.replace(do_rotary=True, head_size=64))


def test_fp16_error_of_ort_is_small():
    c = GqaCase(batch=1, seq=64, num_heads=8, kv_num_heads=2, head_size=128, dtype="fp16",
                do_rotary=True)  # fmt: skip
    got, want = c.run(MS_DOMAIN), c.reference()
    assert np.nanmax(np.abs(got[0].astype(float) - want[0])) < 3e-3


def test_bf16_has_no_ort_cpu_kernel():
    c = GqaCase(batch=1, seq=4, head_size=16, dtype="bf16")
    with pytest.raises(Exception, match="NOT_IMPLEMENTED|Could not find an implementation"):
        c.run(MS_DOMAIN)


def test_fp32_cache_with_fp16_query_accepted_by_ort():
    # ORT's T_CACHE is independent of T: a float32 cache with float16 query runs (ours refuses).
    c = GqaCase(batch=1, kind="decode", past_len=5, head_size=16, dtype="fp16")
    f = dict(c.feeds())
    f["past_key"] = f["past_key"].astype(np.float32)
    f["past_value"] = f["past_value"].astype(np.float32)
    out = _run_ms(f, c.attrs())
    assert out[1].dtype == np.float32
    np.testing.assert_array_equal(out[0], c.run(MS_DOMAIN)[0])


def test_qk_norm_refused_by_ort_cpu():
    c = GqaCase(batch=1, kind="decode", past_len=5, head_size=16)
    f = dict(
        c.feeds(), q_norm_weight=np.ones(16, np.float32), k_norm_weight=np.ones(16, np.float32)
    )
    with pytest.raises(Exception, match="q_norm_weight"):
        _run_ms(f, c.attrs())


def test_qk_norm_oracle_order():
    """No CPU kernel to compare with: check the oracle's own rule (norm, then rotary)."""
    c = GqaCase(batch=1, seq=3, head_size=16, do_rotary=True)
    f = dict(c.feeds(), q_norm_weight=np.linspace(0.5, 2, 16).astype(np.float32),
             k_norm_weight=np.linspace(2, 0.5, 16).astype(np.float32))  # fmt: skip
    a = ref.gqa_reference(f, c.attrs(), 0)
    b = ref.gqa_reference(f, c.attrs(), 0, variant=frozenset(["rotary_before_norm"]))
    assert not np.allclose(a[1][:, :, :3], b[1][:, :, :3])
    # With no rotary and unit weights RMS-norm only rescales rows: k rows get unit RMS.
    f2 = dict(
        c.feeds(), q_norm_weight=np.ones(16, np.float32), k_norm_weight=np.ones(16, np.float32)
    )
    k = ref.gqa_reference(f2, dict(c.attrs(), do_rotary=0), 0)[1]
    np.testing.assert_allclose(np.sqrt(np.mean(k[0, :, :3] ** 2, -1)), 1.0, rtol=1e-5)


# What ORT's CPU kernel refuses (docs/CONTRACT.md section 10), with its message.
_C = GqaCase(batch=2, kind="decode", past_len=5, num_heads=4, kv_num_heads=2, head_size=16)
_F = _C.feeds()
_A = _C.attrs()
_COS = np.ones((20, 8), np.float32)
REJECTS = [
    ("heads", _F, dict(_A, kv_num_heads=3), r"multiple of kv_num_heads"),
    ("key_only", dict(_F, value=None), _A, r"'key' and 'value'"),
    ("rotary_no_cos", _F, dict(_A, do_rotary=1), r"cos_cache"),
    ("past_heads", dict(_F, past_key=np.zeros((2, 3, 5, 16), np.float32),
                        past_value=np.zeros((2, 3, 5, 16), np.float32)), _A, r"past_key"),
    ("past_head_size", dict(_F, past_key=np.zeros((2, 2, 5, 8), np.float32),
                            past_value=np.zeros((2, 2, 5, 8), np.float32)), _A, r"past_key"),
    ("seqlens_neg", dict(_F, seqlens_k=np.array([-1, 3], np.int32)), _A, r"seqlens_k"),
    ("seqlens_huge", dict(_F, seqlens_k=np.array([10**6, 3], np.int32)), _A, r"seqlens_k"),
    ("past_short", dict(_F, past_key=_F["past_key"][:, :, :3].copy(),
                        past_value=_F["past_value"][:, :, :3].copy()), _A,
     r"total_sequence_length"),
    ("batch_seqlens", dict(_F, seqlens_k=np.array([5, 5, 5], np.int32)), _A, r"seqlens_k"),
    ("batch_key", dict(_F, key=np.zeros((3, 1, 32), np.float32),
                       value=np.zeros((3, 1, 32), np.float32)), _A, r"batch"),
    ("chunk_batch", GqaCase(batch=2, seq=3, kind="chunk", past_len=7).feeds(),
     GqaCase().attrs(), r"batch_size must be 1"),
    ("rotary_head_size", GqaCase(seq=4, head_size=40, do_rotary=True).feeds(),
     dict(GqaCase().attrs(), do_rotary=1), r"multiple of 16"),
    ("rotary_dim", GqaCase(seq=4, head_size=32, do_rotary=True, rotary_dim=8).feeds(),
     dict(GqaCase().attrs(), do_rotary=1), r"cos_cache"),
    ("bias_dims", dict(_F, attention_bias=np.ones((2, 4, 1, 5), np.float32)), _A,
     r"attention_bias"),
    ("head_sink", dict(_F, head_sink=np.ones(3, np.float32)), _A, r"head_sink"),
    ("position_ids", dict(_F, position_ids=np.array([[1000], [2]], np.int64), cos_cache=_COS,
                          sin_cache=_COS), dict(_A, do_rotary=1), r"position_ids"),
    ("causal_window", _F, dict(_A, causal=0, local_window_size=3), r"local_window_size"),
    ("swc_no_window", _F, dict(_A, sliding_window_cache=1), r"local_window_size"),
    ("swc_small", _F, dict(_A, sliding_window_cache=1, local_window_size=8), r"local_window_size"),
    ("qk_output", _F, dict(_A, qk_output=1), r"qk_output"),
    ("kv_layout", _F, dict(_A, kv_layout=1), r"kv_layout|[Uu]nrecognized"),
    ("swc_padded_prompt", GqaCase(batch=2, seq=9, pad=4, local_window_size=4,
                                  sliding_window_cache=True).feeds(),
     dict(GqaCase().attrs(), local_window_size=4, sliding_window_cache=1), r"too small"),
]  # fmt: skip


@pytest.mark.parametrize("name,feeds,attrs,match", REJECTS, ids=[r[0] for r in REJECTS])
def test_ort_rejects(name, feeds, attrs, match):
    with pytest.raises(Exception, match=match):
        _run_ms(feeds, attrs)


def test_ort_rejects_shared_total_beyond_capacity():
    c = GqaCase(batch=2, kind="decode", past_len=5, extra_capacity=2, shared=True, head_size=16)
    f = dict(c.feeds(), total_sequence_length=np.array(100, np.int32))
    with pytest.raises(Exception, match="total_sequence_length"):
        _run_ms(f, c.attrs(), shared=True)
    f = dict(c.feeds(), seqlens_k=np.array([10**6, 3], np.int32))
    with pytest.raises(Exception, match="seqlens_k"):
        _run_ms(f, c.attrs(), shared=True)
