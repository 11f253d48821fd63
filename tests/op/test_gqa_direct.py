"""The op's direct call (`_C.gqa_cpu`: numpy arrays in, (output, present_key, present_value)
out; docs/CONTRACT.md) against the float64 reference: every step kind and layout, with and
without rotary, a shared cache and packed QKV (a chunk at batch 1: more needs query_seqlens).
Absent inputs must read as absent (a default pybind11 array is an empty array, not a null
handle: its pointer once passed for position_ids, attention_bias and the norm weights, and the
call returned NaN)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gqa_case import GqaCase, compare

CASES = list(itertools.product(("prompt", "decode", "chunk"), (0, 1), (False, True),
                               (False, True), (False, True)))  # fmt: skip


@pytest.mark.parametrize("kind,layout,rotary,shared,packed", CASES)
def test_direct_call_equals_the_reference(kind, layout, rotary, shared, packed):
    from ort_kvlayout import _C

    c = GqaCase(
        batch=1 if kind == "chunk" else 2, seq=1 if kind == "decode" else 4, kind=kind, past_len=5, num_heads=4,
        kv_num_heads=2, head_size=16, kv_layout=layout, do_rotary=rotary, shared=shared,
        packed=packed, extra_capacity=2 if shared else 0,
    )  # fmt: skip
    feeds = {k: np.array(v, copy=True) for k, v in c.feeds().items() if v is not None}
    if shared and "past_key" not in feeds:
        pytest.skip("a first prompt has no past to share")
    got = _C.gqa_cpu(feeds, dict(c.attrs(), kv_layout=layout), shared, 1)
    compare(c, got, c.reference())


def test_threads_give_the_same_bits():
    from ort_kvlayout import _C

    c = GqaCase(batch=3, seq=7, kind="prompt", num_heads=8, kv_num_heads=2, head_size=40,
                kv_layout=1)  # fmt: skip
    feeds = {k: v for k, v in c.feeds().items() if v is not None}
    one = _C.gqa_cpu(feeds, dict(c.attrs(), kv_layout=1), False, 1)
    two = _C.gqa_cpu(feeds, dict(c.attrs(), kv_layout=1), False, 2)
    compare(c, one, c.reference())
    rows, pmask = c.masks()
    assert np.array_equal(one[0][rows], two[0][rows])
    assert np.array_equal(one[1][pmask], two[1][pmask])
