"""tools/perf/cold_parts.py: each round's timed call is what follows the warmer's events, which are
dropped by count and checked by name (the warmer and the timed call run kernels of one name)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from bench_util import load_perf


@pytest.fixture(scope="module")
def cold_parts():
    return load_perf("cold_parts")


def _ev(name, us):
    return SimpleNamespace(name=name, device_time_total=us)


def test_drops_each_rounds_warmer_and_sums_the_rest(cold_parts):
    pre = sorted(["reduce", "Decode", "memset"])
    rounds = [
        [_ev("reduce", 30.0), _ev("memset", 1.0), _ev("Decode", 11.0), _ev("Decode", 19.0)],
        [_ev("memset", 1.0), _ev("reduce", 31.0), _ev("Decode", 10.5), _ev("Decode", 18.0)],
    ]
    events = [e for r in rounds for e in r]
    assert cold_parts.round_times(events, 2, pre) == [19.0, 18.0]


def test_refuses_rounds_that_do_not_start_with_the_warmer(cold_parts):
    pre = ["reduce"]
    events = [_ev("reduce", 30.0), _ev("Decode", 19.0), _ev("Decode", 18.0), _ev("reduce", 30.0)]
    with pytest.raises(RuntimeError, match="round 1"):
        cold_parts.round_times(events, 2, pre)


def test_refuses_an_uneven_count(cold_parts):
    events = [_ev("reduce", 30.0), _ev("Decode", 19.0), _ev("Decode", 18.0)]
    with pytest.raises(RuntimeError, match="not a fixed set"):
        cold_parts.round_times(events, 2, ["reduce"])
