"""The KV cache on synthetic specs (no model): layout ranges, growth, accounting, errors (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from ort_kvlayout.op.layout import live_ranges, to_layout
from ort_kvlayout.runtime.kv_cache import KvCache, KvCapacityError
from ort_kvlayout.runtime.kv_memory import (
    HostReservation,
    KvMemoryError,
    allocator_stats,
    granule_runs,
    simulate_commit_failure,
)
from ort_kvlayout.runtime.model_spec import KvSpec

PAGE = 4096


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test leaves the host allocator's totals as it found them, and no armed hook."""
    before = allocator_stats()["cpu"]
    yield
    simulate_commit_failure("cpu", -1)
    assert allocator_stats()["cpu"] == before


def spec(layout: int, kv_heads: int = 4, head_dim: int = 64, layers: int = 2, ctx: int = 512):
    return KvSpec.synthetic(layers, kv_heads, head_dim, np.float32, layout, ctx)


def ranges_by_marking(layout, kv_heads, capacity, head_dim, tokens):
    """Independent oracle: mark the live rows of a logical array, lay it out, read the runs."""
    logical = np.zeros((len(tokens), kv_heads, capacity, head_dim), np.uint8)
    for b, t in enumerate(tokens):
        logical[b, :, :t, :] = 1
    flat = to_layout(logical, layout).reshape(-1)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flat, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("tokens", [[1], [5], [64], [3, 0, 17], [64, 64], [7, 64]])
def test_live_ranges_match_the_layout(layout, tokens):
    got = live_ranges(layout, 4, 64, 8, tokens)
    assert got == ranges_by_marking(layout, 4, 64, 8, tokens)
    if layout == 1:  # seq-major: one dense prefix per entry with tokens
        assert len(got) == sum(t > 0 for t in tokens) or tokens == [64, 64]
    elif max(tokens) < 64:  # head-major: one prefix per (entry, head)
        assert len(got) == 4 * sum(t > 0 for t in tokens)


def test_live_ranges_refuse_more_than_capacity():
    with pytest.raises(ValueError, match="batch entry 1: 65 tokens, capacity is 64"):
        live_ranges(1, 4, 64, 8, [1, 65])


def test_granule_runs():
    assert granule_runs([(1, 2), (9000, 9001)], PAGE) == [(0, PAGE), (2 * PAGE, PAGE)]
    assert granule_runs([(1, 2), (4095, 4097), (9000, 9001)], PAGE) == [(0, 3 * PAGE)]  # touching
    assert granule_runs([(0, 0)], PAGE) == []


@pytest.mark.parametrize("layout", [0, 1])
def test_growable_commits_follow_live_tokens(layout):
    s = spec(layout)
    per_entry = 512 * s.token_bytes  # the fixed stride: the whole context
    with KvCache.create(s, "growable", batch=1) as cache:
        assert cache.stats.committed_bytes == 0 and cache.measured_committed_bytes() == 0
        assert cache.stats.reserved_bytes == s.buffers * per_entry
        for t in (1, 2, 3, 4, 5, 17, 100, 511, 512):
            cache.ensure([t])
            ranges = live_ranges(layout, s.kv_heads, 512, s.head_dim, [t])
            expected = sum(size for _, size in granule_runs(
                [(a * 4, b * 4) for a, b in ranges], PAGE
            ))  # fmt: skip
            assert cache.stats.committed_bytes == s.buffers * expected
            assert cache.measured_committed_bytes() == cache.stats.committed_bytes  # mincore
            live = t * s.token_bytes
            if layout == 1:  # within one granule per buffer of the live bytes
                assert expected - live < PAGE
            else:  # one prefix per head: each rounds up on its own
                assert expected >= min(s.kv_heads * PAGE, per_entry)
        assert cache.stats.bytes_moved == 0


def test_seq_major_commits_a_kv_heads_fraction_of_head_major():
    s_seq, s_head = spec(1, kv_heads=8, head_dim=128), spec(0, kv_heads=8, head_dim=128)
    with KvCache.create(s_seq, "growable") as seq, KvCache.create(s_head, "growable") as head:
        buffers = s_seq.buffers
        for t in (1, 2, 4, 8):  # 4 KiB a token: t pages seq-major; a page per head prefix
            seq.ensure(t)
            head.ensure(t)
            assert seq.stats.committed_bytes == buffers * t * PAGE
            assert head.stats.committed_bytes == buffers * 8 * PAGE


def test_growth_moves_nothing_and_keeps_the_prefix():
    s = spec(1)
    with KvCache.create(s, "growable", batch=2) as cache:
        cache.ensure([10, 3])
        before = [b.ptr for b in cache.buffers]
        res = cache._reservations[0]
        pattern = np.arange(10 * s.token_bytes, dtype=np.uint8)
        res.write(0, pattern.tobytes())
        growths = cache.stats.growth_events
        for t in range(11, 400, 7):
            growths += cache.ensure([t, t // 2])
        assert growths >= 10 and cache.stats.growth_events == growths
        assert [b.ptr for b in cache.buffers] == before
        assert cache.read_bytes(0, 0, pattern.size) == pattern.tobytes()
        assert cache.stats.bytes_moved == 0 and cache.generation == 0


@pytest.mark.parametrize("layout", [0, 1])
def test_bucket_restrides_and_counts_bytes_moved(layout):
    s = spec(layout)
    rng = np.random.default_rng(0)
    with KvCache.create(s, "bucket", batch=2, bucket_tokens=16) as cache:
        assert cache.capacity == 16
        cache.ensure([16, 9])
        logical = rng.normal(size=(2, s.kv_heads, 16, s.head_dim)).astype(np.float32)
        logical[1, :, 9:] = 0  # rows past the live length are not carried over
        for i, buf in enumerate(cache.buffers):
            cache._reservations[i].write(0, to_layout(logical + i, layout).tobytes())
        ptrs = [b.ptr for b in cache.buffers]
        assert cache.ensure([17, 9])  # full: doubles to 32, re-strided
        assert cache.capacity == 32 and cache.generation == 1
        assert [b.ptr for b in cache.buffers] != ptrs
        assert cache.stats.bytes_moved == s.buffers * (16 + 9) * s.token_bytes
        for i in range(s.buffers):
            got = cache.logical(i)
            np.testing.assert_array_equal(got[:, :, :16][0], (logical + i)[0])
            np.testing.assert_array_equal(got[1, :, :9], (logical + i)[1, :, :9])
        cache.ensure([100, 9])
        assert cache.capacity == 112 and cache.stats.growth_events == 2


def test_preallocated_commits_everything_up_front():
    s = spec(1)
    with KvCache.create(s, "preallocated", batch=2, capacity=64) as cache:
        assert (
            cache.stats.committed_bytes
            == cache.stats.reserved_bytes
            == s.buffers * 2 * 64 * (s.token_bytes)
        )
        assert cache.measured_committed_bytes() == cache.stats.committed_bytes
        assert not cache.ensure([64, 64]) and cache.stats.growth_events == 0


@pytest.mark.parametrize("mode", ["preallocated", "growable", "bucket"])
def test_past_the_reserved_context_is_a_clear_error(mode):
    with KvCache.create(spec(1), mode, capacity=100) as cache:
        cache.ensure([100])
        with pytest.raises(KvCapacityError, match="needs 101 tokens; the KV cache holds 100"):
            cache.ensure([101])
    with pytest.raises(KvCapacityError, match="exceeds the model's context length 512"):
        KvCache.create(spec(1), mode, capacity=513)


def test_failed_commit_leaves_a_usable_cache():
    s = spec(1)
    with KvCache.create(s, "growable") as cache:
        cache.ensure([5])
        committed = cache.stats.committed_bytes
        simulate_commit_failure("cpu", after=0)
        with pytest.raises(KvMemoryError, match="ENOMEM.*simulated"):
            cache.ensure([100])
        assert cache.tokens == [5] and cache.stats.committed_bytes == committed
        assert cache.measured_committed_bytes() == committed
        cache.ensure([100])  # the hook fired once: the retry commits
        assert cache.stats.committed_bytes == s.buffers * -(-100 * s.token_bytes // PAGE) * PAGE


def test_close_releases_everything_and_is_final():
    baseline = allocator_stats()["cpu"]
    cache = KvCache.create(spec(0), "growable", batch=3)
    cache.ensure([40, 1, 7])
    assert allocator_stats()["cpu"]["committed_bytes"] > baseline["committed_bytes"]
    cache.close()
    cache.close()
    assert allocator_stats()["cpu"] == baseline
    with pytest.raises(ValueError, match="closed"):
        cache.ensure([1, 1, 1])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="cache mode 'paged'"):
        KvCache.create(spec(1), "paged")
    with pytest.raises(ValueError, match="batch must be >= 1"):
        KvCache.create(spec(1), batch=0)
    with KvCache.create(spec(1), batch=2) as cache, pytest.raises(ValueError, match="1 token"):
        cache.ensure([3])
    with pytest.raises(ValueError, match="multiple of the page size"):
        HostReservation(1 << 20, granule=1000)


def test_device_cache_without_a_usable_gpu_is_a_clear_error():
    from gpu_util import SKIP_REASON

    if SKIP_REASON is None:
        pytest.skip("a GPU is usable here: tests/test_kv_cache_gpu.py covers the device")
    # Without CUDA in _C: "built without CUDA"; with it but no driver: "cannot load the CUDA
    # driver libcuda.so.1"; onnxruntime without the CUDA EP refuses the allocation by name.
    with pytest.raises(KvMemoryError, match="CUDA|cuda"):
        KvCache.create(spec(1), "growable", device="cuda")
    with pytest.raises(KvMemoryError, match="cuda"):
        KvCache.create(spec(1), "preallocated", device="cuda")


def test_host_reservation_refuses_ranges_outside_its_committed_granules():
    """read/write/copy_from check the range like the device reservation's CheckMapped: past the
    mapping a memmove would crash the process, into an uncommitted granule it would commit
    memory the accounting does not see."""
    res, other = HostReservation(4 * PAGE, PAGE), HostReservation(4 * PAGE, PAGE)
    try:
        res.commit(0, 2 * PAGE)
        other.commit(0, PAGE)
        res.write(PAGE, b"abc")
        assert res.read(PAGE, 3) == b"abc"
        for call in (
            lambda: res.read(4 * PAGE - 2, 3),
            lambda: res.write(-1, b"x"),
            lambda: res.read(0, 1 << 40),
        ):
            with pytest.raises(ValueError, match="outside the reservation of 16384 bytes"):
                call()
        with pytest.raises(ValueError, match="uncommitted granule"):
            res.write(2 * PAGE - 1, b"xy")  # the second byte is in granule 2
        with pytest.raises(ValueError, match="uncommitted granule"):
            res.copy_from(0, other, PAGE, 8)  # the source's granule 1 is not committed
        res.copy_from(0, other, 0, 8)
        assert res.committed_bytes == 2 * PAGE and res.resident_bytes() == 2 * PAGE
    finally:
        res.close()
        other.close()


@pytest.mark.parametrize("layout", [0, 1])
def test_prefix_tokens_inverts_prefix_spans(layout):
    from ort_kvlayout.op.layout import prefix_spans, prefix_tokens

    for t in range(1, 65):
        for b, start, end in prefix_spans(layout, 4, 64, 8, [t, t]):
            assert prefix_tokens(layout, 4, 64, 8, end - start) == t
            assert prefix_tokens(layout, 4, 64, 8, end - start - 1) == t - 1
            assert b in (0, 1)
    assert prefix_tokens(layout, 4, 64, 8, 10**9) == 64  # at most the capacity
