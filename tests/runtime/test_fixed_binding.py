"""The arena layout of FixedBinding's small CUDA inputs and CallUpload's one copy (the
bindings run in the GPU tests: tests/runtime/test_kv_cache_gpu.py,
tests/serve/test_engine_gpu.py)."""

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


class _Recorder:
    """An IOBinding that records bind_input(name, device, id, dtype, shape, pointer)."""

    def __init__(self):
        self.bound = {}

    def bind_input(self, name, device, device_id, dtype, shape, pointer):
        self.bound[name] = (device, device_id, np.dtype(dtype), tuple(shape), pointer)


def test_call_upload_copies_once_binds_at_offsets_and_keeps_its_buffers(monkeypatch):
    import onnxruntime as ort
    from ort_kvlayout.runtime.fixed_binding import CallUpload

    made, copies = [], []

    class Device:  # a device buffer: its bytes, its address
        def __init__(self, host):
            self.bytes = host.copy()
            made.append(self)
            self.address = len(made) << 20

        def update_inplace(self, host):
            copies.append(host.nbytes)
            self.bytes[...] = host

        def data_ptr(self):
            return self.address

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(lambda a, *_: Device(a)))
    upload = CallUpload(device_id=3)
    ids = np.arange(7, dtype=np.int64)[None, :]
    feeds = {"ids": ids, "lens": np.array([5, 2], np.int32), "top_p": np.ones(2, np.float32)}
    binding = _Recorder()
    upload.bind(binding, feeds)
    offsets, size = arena_layout(feeds, limit=1 << 40)
    (device,) = made
    assert copies == [device.bytes.nbytes] and device.bytes.nbytes >= size
    for name, array in feeds.items():
        where, dev_id, dtype, shape, pointer = binding.bound[name]
        assert (where, dev_id, dtype, shape) == ("cuda", 3, array.dtype, array.shape)
        at = pointer - device.data_ptr()
        assert at == offsets[name]
        got = device.bytes[at : at + array.nbytes].view(array.dtype).reshape(array.shape)
        assert np.array_equal(got, array)
    three = {"ids": ids[:, :3], "lens": np.array([1], np.int32), "top_p": np.ones(1, np.float32)}
    upload.bind(binding, three)  # other shapes, the same size class: the same buffer
    assert len(made) == 1 and upload.uploads == 2
    upload.bind(binding, {"mask": np.ones((64, 4096), np.int64)})  # 2 MiB: a class of its own
    assert len(made) == 2 and made[1].bytes.nbytes == 2 * 1024 * 1024 and upload.uploads == 3
