"""The KV cache on synthetic specs (no model): layout ranges, growth, accounting, errors (CPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
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


@pytest.mark.parametrize("layout", [0, 1])
def test_covers_says_whether_ensure_would_commit(layout):
    """covers() is ensure()'s "nothing to commit": true up to the end of the granules an
    entry's rows committed, false past them, and false again once the entry is released."""
    s = spec(layout)
    with KvCache.create(s, "growable", batch=2) as cache:
        assert cache.covers([0, 0]) and not cache.covers([1, 0])
        cache.ensure([3, 1])
        committed = cache.stats.committed_bytes
        # a 4 KiB page holds 4 rows of 4 heads x 64 floats (seq-major), or 16 rows of a head
        per_page = PAGE // (4 * 64 * 4) if layout == 1 else PAGE // (64 * 4)
        assert cache.covers([per_page, 1]) and not cache.covers([per_page + 1, 1])
        for tokens in ([per_page, 1], [2, 1]):
            assert not cache.ensure(tokens)  # covered: nothing committed
        assert cache.stats.committed_bytes == committed
        assert cache.ensure([per_page + 1, 1])
        cache.release(0)
        assert not cache.covers([1, 1]) and cache.covers([0, 1])


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
        pytest.skip("a GPU is usable here: tests/runtime/test_kv_cache_gpu.py covers the device")
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


# ---------------------------------------------------------------------------------------------
# Quantized caches: narrow element types, packed int4 rows, PER_TOKEN scale caches.


def qspec(dtype, bits=0, quant="none", layout=1, head_dim=64):
    return KvSpec.synthetic(2, 4, head_dim, dtype, layout, 2048, bits, quant)


@pytest.mark.parametrize("layout", [0, 1])
def test_narrow_caches_commit_a_half_and_a_quarter(layout):
    """1024 live tokens of 4 heads x 64: fp16 512 KiB a buffer, int8 and fp8 half, int4 a
    quarter (rows of 32 bytes); exact, the pages being filled."""
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    committed = {}
    for name, dtype, bits in [
        ("fp16", np.float16, 0), ("int8", np.int8, 8), ("fp8", fp8, 8), ("int4", np.uint8, 4)
    ]:  # fmt: skip
        s = qspec(dtype, bits, "per_tensor" if bits else "none", layout)
        with KvCache.create(s, "growable", capacity=1024) as cache:
            cache.ensure(1024)
            committed[name] = cache.stats.committed_bytes
            assert cache.stats.live_bytes == committed[name] == cache.commit_bytes([1024])
            assert cache.buffers[0].shape == (1, 4, 1024, s.row)
            assert cache.buffers[0].dtype == np.dtype(dtype)
    assert committed["fp16"] == 4 * 512 * 1024
    assert committed["int8"] == committed["fp8"] == committed["fp16"] // 2
    assert committed["int4"] == committed["fp16"] // 4


def test_packed_int4_row_and_element_types():
    assert qspec(np.uint8, 4, "per_tensor", head_dim=5).row == 3  # odd H: (H + 1) // 2 bytes
    assert qspec(np.int8, 8, "per_channel").row == 64
    fp8 = qspec(ml_dtypes.float8_e4m3fn, 8, "per_token")
    assert fp8.element_type == onnx.TensorProto.FLOAT8E4M3FN
    with KvCache.create(fp8, "growable", capacity=64) as cache:
        assert {b.element_type for b in cache.buffers} == {
            onnx.TensorProto.FLOAT8E4M3FN,
            onnx.TensorProto.FLOAT,
        }


@pytest.mark.parametrize("layout", [0, 1])
def test_per_token_scale_caches_travel_with_the_cache(layout):
    s = qspec(np.int8, 8, "per_token", layout)
    with KvCache.create(s, "growable", batch=2, capacity=1024) as cache:
        scales = cache.buffers[4:]
        assert [b.past for b in scales] == [
            "past_key_scale.0", "past_value_scale.0", "past_key_scale.1", "past_value_scale.1"
        ]  # fmt: skip
        assert all(b.shape == (2, 4, 1024) and b.dtype == np.float32 for b in scales)
        pointers = [b.ptr for b in cache.buffers]
        cache.ensure([1024, 256])
        assert [b.ptr for b in cache.buffers] == pointers  # grown in place
        st = cache.stats
        kv_bytes = 4 * (1024 + 256) * 4 * 64  # int8 rows: whole pages in both layouts
        scale_bytes = st.scale_committed_bytes
        # (B, Nkv, C) float32 with head_dim 1: entry 0's 1024 x 4 x 4 bytes are whole pages,
        # entry 1's 256 rows one page (seq-major: one prefix) or 4 (head-major: 1 KiB a head).
        need = 4 * (1024 * 16 + (PAGE if layout else 4 * PAGE))
        assert scale_bytes == need
        assert st.committed_bytes == kv_bytes + scale_bytes == cache.commit_bytes([1024, 256])
        assert st.live_bytes == kv_bytes + 4 * (1024 + 256) * 4 * 4
        assert cache.entry_commit_bytes(1024) == 4 * 1024 * 4 * 64 + 4 * 1024 * 16
        view = cache.entry_buffers(1, 1)
        assert view[4].ptr == scales[0].ptr + 1024 * 4 * 4 and view[4].shape == (1, 4, 1024)
        released = cache.release(1)
        assert released == 4 * 256 * 4 * 64 + (scale_bytes - 4 * 1024 * 16)
        assert cache.stats.committed_bytes == 4 * 1024 * 4 * 64 + 4 * 1024 * 16
        # A scale buffer reads back in its logical (B, Nkv, C) order, like the cache.
        cache.ensure([1024, 0])
        values = np.arange(4 * 1024, dtype=np.float32).reshape(1, 4, 1024)
        raw = values.transpose(0, 2, 1) if layout else values
        cache._scales._reservations[0].write(0, raw.tobytes())
        np.testing.assert_array_equal(cache.logical(4)[:1], values)


def test_per_token_bucket_restrides_the_scales_too():
    s = qspec(np.int8, 8, "per_token", 1)
    with KvCache.create(s, "bucket", batch=2, capacity=1024, bucket_tokens=16) as cache:
        cache.ensure([16, 9])
        values = np.random.default_rng(0).normal(size=(2, 4, 16)).astype(np.float32)
        values[1, :, 9:] = 0
        cache._scales._reservations[0].write(0, values.transpose(0, 2, 1).tobytes())
        generation = cache.generation
        cache.ensure([40, 9])
        assert cache.generation == generation + 1 and cache.capacity == cache._scales.capacity
        assert all(b.shape[2] == cache.capacity for b in cache.buffers)
        np.testing.assert_array_equal(cache.logical(4)[:, :, :16], values)
        moved = cache.stats.bytes_moved
        assert moved == 4 * (16 + 9) * 4 * 64 + 4 * (16 + 9) * 4 * 4  # KV rows + scale rows
