"""Hypothesis property tests over the whole contract: any valid case, in either layout, matches
the float64 oracle (and ORT's built-in kernel where it has one), and the two layouts agree.
At least 200 examples a run; the failing case is printed (its repr holds the seed)."""

from __future__ import annotations

import numpy as np
import reference as ref
from gqa_case import MS_DOMAIN, Refused, as_f64, check_vs_reference, compare, gqa_cases
from hypothesis import HealthCheck, event, given, note, settings

SETTINGS = {
    "deadline": None,
    "derandomize": False,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}


@settings(max_examples=150, **SETTINGS)
@given(case=gqa_cases())
def test_matches_reference(case):
    note(repr(case))
    try:
        got = case.run_ours()
    except Refused as e:  # allowed by the contract when the message names the feature
        event(f"refused {e.feature}")
        return
    check_vs_reference(case, got)
    if case.dtype == "fp32" and case.kv_layout == 0 and not case.qk_norm:
        compare(case, got, case.run(MS_DOMAIN), what="vs ORT: ")


@settings(max_examples=70, **SETTINGS)
@given(case=gqa_cases(dtypes=("fp32", "fp16", "bf16")))
def test_layouts_agree(case):
    note(repr(case))
    c0, c1 = case.replace(kv_layout=0), case.replace(kv_layout=1)
    try:
        o0, o1 = c0.run_ours(), c1.run_ours()
    except Refused as e:
        event(f"refused {e.feature}")
        return
    rows, pm = c0.masks()
    osel = np.broadcast_to(rows[:, :, None], o0[0].shape)
    np.testing.assert_allclose(as_f64(o0[0])[osel], as_f64(o1[0])[osel], rtol=1e-6, atol=1e-6)
    pm0 = ref.from_layout(pm, 0)
    for p0, p1 in ((o0[1], o1[1]), (o0[2], o1[2])):
        assert p0.shape == p1.shape
        np.testing.assert_array_equal(
            ref.from_layout(as_f64(p0), 0)[pm0], ref.from_layout(as_f64(p1), 1)[pm0]
        )
