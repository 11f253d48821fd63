"""bench/bench_stack.py --rounds: the order in which the three variants' timed steps run."""

from __future__ import annotations

from collections import Counter

import pytest
from bench_util import load_bench


@pytest.fixture(scope="module")
def turns():
    """The stack's turns: bench_cuda.py's, over the stack's variants."""
    bench_stack = load_bench("bench_stack")
    return lambda steps, rounds: bench_stack.bench_cuda.turns(bench_stack.VARIANTS, steps, rounds)


def test_rounds_alternate_the_order_and_split_the_steps_evenly(turns):
    t = turns(10, 3)
    assert [v for v, _ in t] == ["ort", "kv0", "kv1", "kv1", "kv0", "ort", "ort", "kv0", "kv1"]
    assert [n for _, n in t] == [4, 4, 4, 3, 3, 3, 3, 3, 3]
    per_variant = Counter()
    for v, n in t:
        per_variant[v] += n
    assert per_variant == {"ort": 10, "kv0": 10, "kv1": 10}


def test_one_round_is_each_variant_once_and_rounds_never_exceed_steps(turns):
    assert turns(20, 1) == [("ort", 20), ("kv0", 20), ("kv1", 20)]
    assert turns(20, 0) == [("ort", 20), ("kv0", 20), ("kv1", 20)]
    assert len(turns(2, 5)) == 6  # two rounds: no turn of zero steps
    assert all(n > 0 for _, n in turns(2, 5))
