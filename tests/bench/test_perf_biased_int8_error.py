"""tools/perf/biased_int8_error.py: its fp32 accumulation model and its three scores (the model
run itself needs the builder's int8 model and is a measurement, not a test)."""

from __future__ import annotations

import numpy as np
from bench_util import load_perf

tool = load_perf("biased_int8_error")


def test_fp32_sum_rounds_each_addition():
    # 2^24 + 1 is not a float32: one addition at a time loses both ones, a float64 sum does not.
    terms = np.array([[2.0**24, 1.0, 1.0]], np.float32)
    assert tool.fp32_sum(np.zeros(1, np.float32), terms)[0] == 2.0**24
    assert tool.fp32_sum(np.array([1.0], np.float32), terms[:, 1:])[0] == 3.0


def test_small_integers_score_exactly_both_ways():
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 9, size=(3, 64)).astype(np.float32)
    codes = rng.integers(-128, 128, size=(3, 5, 64)).astype(np.int8)
    s = tool.scores(q, codes)
    want = np.einsum("hd,hkd->hk", q.astype(np.int64), codes.astype(np.int64))
    assert np.array_equal(s["exact"], want)
    assert np.array_equal(s["plain"], want) and np.array_equal(s["biased"], want)


def test_biased_error_within_the_fp32_bound_and_above_the_plain_one():
    rng = np.random.default_rng(1)
    q = (rng.standard_normal((9, 64)) * 0.3).astype(np.float16).astype(np.float32)
    codes = rng.integers(-128, 128, size=(9, 256, 64)).astype(np.int8)
    s = tool.scores(q, codes)
    # Each of the 65 roundings is at most half an ulp of a partial sum bounded by the sum of
    # the magnitudes: 1152 x sum |q| for the start, |q| x (1152 + |code|) for the terms.
    mag = tool.BIAS * np.abs(q).sum(axis=1)[:, None] + np.einsum(
        "hd,hkd->hk", np.abs(q), tool.BIAS + np.abs(codes.astype(np.float64))
    )
    assert np.all(np.abs(s["biased"] - s["exact"]) <= 65 * 2.0**-24 * mag)
    assert np.abs(s["biased"] - s["exact"]).max() > 4 * np.abs(s["plain"] - s["exact"]).max()
