"""bench/bench_stack.py --rounds: the order in which the three variants' timed steps run."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "bench_stack", Path(__file__).resolve().parents[1] / "bench" / "bench_stack.py"
)
bench_stack = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_stack)


def test_rounds_alternate_the_order_and_split_the_steps_evenly():
    t = bench_stack.turns(10, 3)
    assert [v for v, _ in t] == ["ort", "kv0", "kv1", "kv1", "kv0", "ort", "ort", "kv0", "kv1"]
    assert [n for _, n in t] == [4, 4, 4, 3, 3, 3, 3, 3, 3]
    per_variant = Counter()
    for v, n in t:
        per_variant[v] += n
    assert per_variant == {"ort": 10, "kv0": 10, "kv1": 10}


def test_one_round_is_each_variant_once_and_rounds_never_exceed_steps():
    assert bench_stack.turns(20, 1) == [("ort", 20), ("kv0", 20), ("kv1", 20)]
    assert bench_stack.turns(20, 0) == [("ort", 20), ("kv0", 20), ("kv1", 20)]
    assert len(bench_stack.turns(2, 5)) == 6  # two rounds: no turn of zero steps
    assert all(n > 0 for _, n in bench_stack.turns(2, 5))
