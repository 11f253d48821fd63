"""The arena layout of FixedBinding's small CUDA inputs (the binding itself runs in the GPU
tests: tests/runtime/test_kv_cache_gpu.py, tests/serve/test_engine_gpu.py)."""

import itertools

import numpy as np
from ort_kvlayout.runtime.fixed_binding import ARENA_LIMIT, arena_layout


def test_small_inputs_share_an_aligned_arena_without_overlap():
    arrays = {
        "input_ids": np.zeros((64, 1), np.int64),
        "seqlens": np.zeros(64, np.int32),
        "one": np.zeros((), np.int32),
        "mask": np.zeros((64, 4096), np.int64),  # 2 MiB: a buffer of its own
        "uniform": np.zeros(3, np.float32),
    }
    offsets, size = arena_layout(arrays)
    assert list(offsets) == ["input_ids", "seqlens", "one", "uniform"]
    assert all(at % 256 == 0 for at in offsets.values())
    spans = sorted((at, at + arrays[n].nbytes) for n, at in offsets.items())
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    assert spans[-1][1] <= size and size % 256 == 0


def test_the_limit_is_inclusive_and_nothing_small_means_no_arena():
    exact = np.zeros(ARENA_LIMIT, np.uint8)
    assert arena_layout({"a": exact}) == ({"a": 0}, ARENA_LIMIT)
    assert arena_layout({"a": np.zeros(ARENA_LIMIT + 1, np.uint8)}) == ({}, 0)
    assert arena_layout({}) == ({}, 0)
