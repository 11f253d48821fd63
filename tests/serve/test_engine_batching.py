"""The engine's pure rules, without a model or a GPU: decode buckets and padded rows
(serve/batching.py), and the KV budget against the device's memory (serve/memory.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ort_kvlayout.serve.batching import (
    bucket_for,
    decode_range,
    decode_rows,
    default_buckets,
    resolve_buckets,
)
from ort_kvlayout.serve.memory import DEFAULT_CUDA_FRACTION, resolve_kv_budget

GIB = 1 << 30


def test_default_buckets():
    assert default_buckets(1) == (1,)
    assert default_buckets(3) == (1, 2, 3)
    assert default_buckets(8) == (1, 2, 4, 8)
    assert default_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    with pytest.raises(ValueError):
        default_buckets(0)


def test_resolve_buckets():
    assert resolve_buckets(None, 8) == default_buckets(8)
    assert resolve_buckets((), 8) == ()
    assert resolve_buckets((4, 2, 2, 16), 8) == (2, 4, 8)  # max_batch always; larger dropped
    assert resolve_buckets((8,), 8) == (8,)
    with pytest.raises(ValueError):
        resolve_buckets((0,), 8)


def test_bucket_for_and_decode_range():
    buckets = (1, 2, 4, 8)
    assert [bucket_for(n, buckets) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError):
        bucket_for(9, buckets)
    assert decode_range([], buckets) is None
    assert decode_range([2, 5], ()) == (2, 6)  # eager: the decoding span
    assert decode_range([2, 5], buckets) == (0, 8)  # padded: [0, bucket)
    assert decode_range([0], buckets) == (0, 1)


def test_decode_rows_padding():
    ids, totals = decode_rows([None, (None, 0), (None, 7), (42, 9)], pad_token=0)
    assert ids == [0, 0, 0, 42]
    # free: row 0 (scratch); prefilling: its next row (its next chunk overwrites it); decoding:
    # its token at row `cached`
    assert totals == [1, 1, 8, 10]
    with pytest.raises(ValueError):
        decode_rows([(1, -1)], pad_token=0)


@given(
    max_batch=st.integers(1, 80),
    decoding=st.sets(st.integers(0, 79), min_size=1),
    step=st.sampled_from([4, 8, 16]),
)
def test_a_padded_range_holds_every_decoding_slot_and_no_more_than_needed(
    max_batch, decoding, step
):
    decoding = {s for s in decoding if s < max_batch} or {0}
    buckets = default_buckets(max_batch, step)
    lo, hi = decode_range(sorted(decoding), buckets)
    assert lo == 0 and max(decoding) < hi <= max_batch and hi in buckets
    # padding past the highest decoding slot: below the next bucket's gap
    gaps = [b - a for a, b in zip((0, *buckets), buckets)]
    assert hi - (max(decoding) + 1) < max(gaps)


@given(
    st.lists(
        st.one_of(
            st.none(),
            st.tuples(st.none(), st.integers(0, 1022)),
            st.tuples(st.integers(1, 99), st.integers(0, 1022)),
        ),
        min_size=1,
        max_size=16,
    )
)
def test_padded_rows_stay_in_bounds(slots):
    """Every row's seqlens_k (total - 1) lies in [0, capacity) for a capacity of 1024 rows; a free
    slot writes row 0 of its own slot only; a prefilling one its next row."""
    capacity = 1024
    ids, totals = decode_rows(slots, pad_token=0)
    assert len(ids) == len(totals) == len(slots)
    for state, token, total in zip(slots, ids, totals):
        assert 0 <= total - 1 < capacity
        if state is None:
            assert (token, total) == (0, 1)
        else:
            assert total == state[1] + 1
            assert token == (0 if state[0] is None else state[0])


# --- the KV budget -------------------------------------------------------------------------


def test_budget_as_a_fraction_of_free_memory():
    assert resolve_kv_budget(None, 0.5, 10 * GIB, 80 * GIB, "cuda:0") == 5 * GIB
    assert resolve_kv_budget(None, 1.0, 3, 8, "cpu") == 3
    with pytest.raises(ValueError, match="cannot read the free memory"):
        resolve_kv_budget(None, 0.5, None, None, "cuda:0")
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        resolve_kv_budget(None, 1.5, 10, 10, "cpu")
    with pytest.raises(ValueError, match="not both"):
        resolve_kv_budget(5, 0.5, 10, 10, "cpu")
    with pytest.raises(ValueError, match="fraction of 1e-12 of the 10737418240 bytes free on cpu"):
        resolve_kv_budget(None, 1e-12, 10 * GIB, 80 * GIB, "cpu")
    with pytest.raises(ValueError, match=r"cpu has no free memory for a KV cache \(0 bytes"):
        resolve_kv_budget(None, 0.5, 0, 80 * GIB, "cpu")


def test_default_budget():
    assert resolve_kv_budget(None, None, 10 * GIB, 80 * GIB, "cpu") is None  # the reservation
    got = resolve_kv_budget(
        None, None, 10 * GIB, 80 * GIB, "cuda:0", default_fraction=DEFAULT_CUDA_FRACTION
    )
    assert got == int(DEFAULT_CUDA_FRACTION * 10 * GIB)


def test_a_budget_larger_than_the_device_is_refused():
    cuda = {"device": "cuda:0", "default_fraction": DEFAULT_CUDA_FRACTION}
    assert resolve_kv_budget(40 * GIB, None, 70 * GIB, 80 * GIB, **cuda) == 40 * GIB
    with pytest.raises(ValueError, match=r"more than cuda:0's memory \(85899345920 bytes\)"):
        resolve_kv_budget(100 * GIB, None, 70 * GIB, 80 * GIB, **cuda)
    # device memory is not overcommitted: more than is free once the model is loaded is refused
    with pytest.raises(ValueError, match="bytes free on cuda:0 once the model is loaded"):
        resolve_kv_budget(75 * GIB, None, 70 * GIB, 80 * GIB, **cuda)
    # the host: more than the machine's memory is refused; more than is available is not
    with pytest.raises(ValueError, match="more than this machine's memory"):
        resolve_kv_budget(100 * GIB, None, 10 * GIB, 64 * GIB, "cpu")
    assert resolve_kv_budget(32 * GIB, None, 10 * GIB, 64 * GIB, "cpu") == 32 * GIB
    assert resolve_kv_budget(32 * GIB, None, None, None, "cpu") == 32 * GIB  # unknown: taken


def test_engine_resolves_the_budget_from_the_device_once(tmp_path, monkeypatch):
    """The engine asks the device's memory once at start (a stand-in device here) and refuses a
    budget over it before allocating anything."""
    from ort_kvlayout.runtime.kv_memory import allocator_stats
    from ort_kvlayout.serve import memory
    from ort_kvlayout.serve.engine import Engine, EngineConfig
    from ort_kvlayout.tools.patch import patch_model_dir
    from serve_util import library_or_skip
    from synthetic_models import Variant, make_model_dir

    library_or_skip()
    src = make_model_dir(tmp_path / "original", Variant(layers=1))
    model = patch_model_dir(src, tmp_path / "seq", layout="seq-major").out_dir
    calls = []

    def fake(provider, device_id=0):
        calls.append((provider, device_id))
        return 1 << 20, 4 << 20  # 1 MiB free of 4 MiB

    monkeypatch.setattr(memory, "device_memory", fake)
    with Engine(model, EngineConfig(kv_budget_fraction=0.5), start=False) as eng:
        assert eng.budget == 1 << 19
        assert eng.stats()["kv_budget_bytes"] == 1 << 19
    assert calls == [("cpu", 0)]
    before = allocator_stats()["cpu"]
    with pytest.raises(ValueError, match="more than this machine's memory"):
        Engine(model, EngineConfig(kv_budget_bytes=5 << 20), start=False)
    assert allocator_stats()["cpu"] == before
