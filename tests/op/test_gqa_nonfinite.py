"""Non-finite inputs and large softcaps on the CPU op and the CUDA op, against ORT's CPU
com.microsoft op (the CUDA cases skip without a GPU; GPU_TOLS bound them).

NaN and Inf propagate by IEEE rules over what a query row attends: a NaN in a query, in an
attended key or value row, or in the bias at an attended key makes that row's output NaN (the
elements ORT's op makes NaN); an +Inf score gives NaN (exp(inf - inf)); a -Inf score gives its
key no weight; a row whose attended scores are all -Inf gives zeros (as ORT). Keys a row does
not attend (causal future, outside the window, beyond its length) never reach it: ORT's CPU
kernel differs there for value rows (it multiplies their zero weight, 0 * NaN = NaN), which the
contract leaves unspecified (docs/CONTRACT.md, section 5).

softcap c * tanh(x / c) stays at float rounding against ORT for every finite c (it used to lose
precision as c grew: 9e-4 off at 1e4, 0.06 at 1e6, 0.86 at 1e8).
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from gpu_util import GPU_TOLS, SKIP_REASON, cuda_session, run_cuda
from gqa_case import KV_DOMAIN, MS_DOMAIN, TOLS, GqaCase, build_model, make_session, run_session

NAN, INF = np.nan, np.inf


def _logical(case: GqaCase) -> dict:
    """The case's inputs with past in head-major (logical) order, as writable copies."""
    f = {k: (None if v is None else np.array(v)) for k, v in case.feeds().items()}
    for k in ("past_key", "past_value"):
        if f.get(k) is not None:
            f[k] = ref.from_layout(f[k], case.kv_layout)
    return f


# Where our op runs: the CPU EP always, the CUDA EP where a GPU and a CUDA build exist.
EPS = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu,
               pytest.mark.skipif(SKIP_REASON is not None, reason=f"GPU tests: {SKIP_REASON}")],
    ),
]  # fmt: skip


def _output(case: GqaCase, logical: dict, domain: str, layout: int, ep: str = "cpu") -> np.ndarray:
    feeds = dict(logical)
    for k in ("past_key", "past_value"):
        if feeds.get(k) is not None:
            feeds[k] = ref.to_layout(feeds[k], layout)
    model = build_model(feeds, case.attrs(), domain, layout if domain == KV_DOMAIN else None)
    if ep == "cuda":
        out = run_cuda(cuda_session(model, domain), feeds, case.attrs())[0]
    else:
        out = run_session(make_session(model, domain), feeds)[0]
    return np.asarray(out).astype(np.float64)


def _atol(dtype: str, ep: str) -> float:
    return (GPU_TOLS[dtype][0] if ep == "cuda" else TOLS[dtype][0]) * 4


def _assert_same_nonfinite(got: np.ndarray, want: np.ndarray, atol: float, what: str) -> None:
    """NaN where `want` has NaN, the same infinities, and the finite elements close."""
    for name, pred in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        g, w = pred(got), pred(want)
        assert np.array_equal(g, w), (
            f"{what}: {name} at {np.argwhere(g != w)[:5].tolist()} differ "
            f"(ours {int(g.sum())}, ORT {int(w.sum())} elements)"
        )
    fin = np.isfinite(want)
    err = float(np.abs(got[fin] - want[fin]).max()) if fin.any() else 0.0
    assert err <= atol, f"{what}: finite elements differ by {err:.3g} > {atol:.3g}"


def _decode(past_len: int, dtype: str = "fp32", **kw) -> GqaCase:
    return GqaCase(batch=1, kind="decode", past_len=past_len, num_heads=4, kv_num_heads=2,
                   head_size=64, dtype=dtype, seed=11, **kw)  # fmt: skip


def _set(*changes):
    """An edit: (input, index, value) changes of the logical inputs."""

    def edit(f):
        for name, index, value in changes:
            f[name][index] = value

    return edit


# Query element 5 of heads 0 and 1 (KV head 0) positive, so an infinite key element 5 gives a
# score of the same sign.
_Q_POS = (("query", (0, 0, 5), 1.0), ("query", (0, 0, 64 + 5), 1.0))


# (case, edit of the logical inputs). Decode over 100 keys: key tiles are 64 wide, so positions
# 0 and 64 start a tile (a NaN there used to drop the tile), 37 and 99 do not. Decode over 1000
# keys splits the keys across tasks (the merge must carry NaN).
_DECODE_EDITS = {
    "nan_key_0": _set(("past_key", (0, 0, 0, 5), NAN)),
    "nan_key_37": _set(("past_key", (0, 0, 37, 5), NAN)),
    "nan_key_64": _set(("past_key", (0, 1, 64, 0), NAN)),
    "nan_key_99": _set(("past_key", (0, 0, 99, 63), NAN)),
    "nan_new_key": _set(("key", (0, 0, 3), NAN)),
    "nan_query_head1": _set(("query", (0, 0, 64 + 3), NAN)),
    "nan_value_37": _set(("past_value", (0, 1, 37, 5), NAN)),
    "nan_value_0": _set(("past_value", (0, 0, 0, 0), NAN)),
    "posinf_key_37": _set(("past_key", (0, 0, 37, 5), INF), *_Q_POS),  # +inf score: NaN
    "neginf_key_37": _set(("past_key", (0, 0, 37, 5), -INF), *_Q_POS),  # -inf score: no weight
    "posinf_value_37": _set(("past_value", (0, 0, 37, 5), INF)),
    "posinf_query": _set(("query", (0, 0, 3), INF)),
}
_FINITE_EDITS = {"neginf_key_37"}


@pytest.mark.parametrize("ep", EPS)
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("past_len", [100, 1000])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("edit", list(_DECODE_EDITS))
def test_decode_nonfinite_as_ort(edit, dtype, past_len, layout, ep):
    """On CUDA fp16 takes the tensor-core decode (split merge by the last CTA), fp32 the
    portable kernel and its combine: both must carry NaN through the merge."""
    c = _decode(past_len, dtype, kv_layout=layout)
    f = _logical(c)
    _DECODE_EDITS[edit](f)
    want = _output(c, f, MS_DOMAIN, 0)
    assert np.isfinite(want).all() == (edit in _FINITE_EDITS), "the edit must matter to ORT"
    got = _output(c, f, KV_DOMAIN, layout, ep)
    _assert_same_nonfinite(got, want, _atol(dtype, ep), f"{ep} {edit} L={past_len + 1}")


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("what", ["nan_one", "posinf_one", "neginf_all"])
def test_bias_nonfinite_as_ort(what, layout):
    c = _decode(20, attention_bias="bn", kv_layout=layout)
    f = _logical(c)
    if what == "nan_one":
        f["attention_bias"][0, 1, 0, 7] = NAN
    elif what == "posinf_one":
        f["attention_bias"][0, 1, 0, 7] = INF
    else:  # every key of head 1 -inf: no weight anywhere, zeros (as ORT)
        f["attention_bias"][0, 1] = -INF
    want = _output(c, f, MS_DOMAIN, 0)
    got = _output(c, f, KV_DOMAIN, layout)
    _assert_same_nonfinite(got, want, 4 * TOLS["fp32"][0], what)
    if what == "neginf_all":
        assert np.all(got[0, 0, 64:128] == 0.0)


@pytest.mark.parametrize("ep", EPS)
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("window", [-1, 3])
def test_prompt_nan_key_reaches_only_rows_that_attend_it(window, layout, ep):
    """A NaN in new key row 5 of a 16-token prompt: rows 5.. (within the window) are NaN,
    the others finite; as ORT."""
    c = GqaCase(batch=1, kind="prompt", seq=16, num_heads=4, kv_num_heads=2, head_size=64,
                local_window_size=window, kv_layout=layout, seed=12)  # fmt: skip
    f = _logical(c)
    f["key"][0, 5, 7] = NAN  # kv head 0
    want = _output(c, f, MS_DOMAIN, 0)
    got = _output(c, f, KV_DOMAIN, layout, ep)
    _assert_same_nonfinite(got, want, 4 * TOLS["fp32"][0], f"window {window}")
    rows_nan = np.isnan(got[0, :, :128]).any(-1)
    attends = (np.arange(16) >= 5) & ((window < 0) | (np.arange(16) < 5 + window))
    assert np.array_equal(rows_nan, attends), rows_nan


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("window", [-1, 3])
def test_prompt_nan_value_reaches_only_rows_that_attend_it(window, layout):
    """A NaN in new value row 5: rows that attend key 5 are NaN in that element; rows that do
    not attend it are unaffected (equal to the clean run). ORT's CPU kernel also makes the
    other rows NaN (0 weight x NaN): unspecified, so only the attending rows are compared."""
    c = GqaCase(batch=1, kind="prompt", seq=16, num_heads=4, kv_num_heads=2, head_size=64,
                local_window_size=window, kv_layout=layout, seed=13)  # fmt: skip
    f = _logical(c)
    clean = _output(c, f, KV_DOMAIN, layout)
    f["value"][0, 5, 7] = NAN  # kv head 0, element 7 -> query heads 0 and 1, element 7
    got = _output(c, f, KV_DOMAIN, layout)
    want = _output(c, f, MS_DOMAIN, 0)
    attends = (np.arange(16) >= 5) & ((window < 0) | (np.arange(16) < 5 + window))
    for h in (0, 1):
        assert np.array_equal(np.isnan(got[0, :, h * 64 + 7]), attends)
    assert np.isnan(got).sum() == 2 * attends.sum()
    rows = ~attends
    np.testing.assert_array_equal(got[0, rows], clean[0, rows])
    _assert_same_nonfinite(got[0, attends], want[0, attends], 4 * TOLS["fp32"][0], "attending")


@pytest.mark.parametrize("ep", EPS)
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("kind", ["decode", "prompt"])
@pytest.mark.parametrize("softcap", [1.0, 30.0, 1e4, 1e6, 1e8, 1e30, 1e-30])
def test_softcap_precision_vs_ort(softcap, kind, layout, ep):
    """c * tanh(x / c) within float rounding of ORT for every finite c (the same bound as
    without softcap; fp32 on both EPs, so the CUDA op keeps the CPU's bound)."""
    c = GqaCase(batch=2, kind=kind, seq=16 if kind == "prompt" else 1, past_len=100,
                num_heads=4, kv_num_heads=2, head_size=64, softcap=softcap, seed=14)  # fmt: skip
    want = np.asarray(c.run(MS_DOMAIN)[0], np.float64)
    ours = c.replace(kv_layout=layout)
    got = _output(ours, _logical(ours), KV_DOMAIN, layout, ep)
    err = float(np.abs(got - want).max())
    bound = 2e-6 if ep == "cpu" else GPU_TOLS["fp32"][0]  # CUDA: fast-math exp in the softmax
    assert err <= bound, f"{ep} softcap {softcap}: {err:.3g} off ORT"
