"""One run of a quantized-cache GQA case through IO binding, on the CPU op or on the CUDA op: the
harness of tests/op/test_gqa_quant.py and tests/op/test_gqa_pertoken.py (``device="cpu"``) and of
tests/op/test_gqa_cuda_quant.py (``device="cuda"``).

Every run binds the inputs the session takes (total_sequence_length in CPU memory, as
onnxruntime-genai binds it), preallocates the outputs (output NaN-filled, separate presents
filled with 0x5A bytes and their scale caches with NaN, so that a defined element the op forgot
to write shows), binds past as present when shared, runs once and returns host copies. Only
where the buffers live differs, and that is the placement's:

* ``HostPlace`` ("cpu"): host numpy arrays with OrtValues over their memory, a fresh session on
  the CPU EP per run.
* ``DevicePlace`` ("cuda"): device OrtValues (tests/helpers/gpu_util.py: ``to_device``,
  ``from_device``, ``device_filled``; CPU OrtValues under GQA_GPU_EMULATE_CPU), a cached session
  on the CUDA EP with CPU fallback disabled (``gpu_util.cuda_session``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import reference as ref
from gpu_util import cuda_session, from_device, to_device, to_device_as
from gqa_case import GqaCase, make_session
from onnx import TensorProto

_BF16 = np.dtype(ml_dtypes.bfloat16)
CACHES = ("past_key", "past_value")


def host_ortvalue(arr: np.ndarray, onnx_type: int | None = None) -> ort.OrtValue:
    """An OrtValue over ``arr``'s memory, of ONNX element type ``onnx_type`` (a float8e4m3fn
    cache held in uint8) or of ``arr``'s dtype (bf16 through a uint16 view: ORT's numpy bridge
    does not know ml_dtypes.bfloat16)."""
    if onnx_type is not None:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, onnx_type)
    if arr.dtype == _BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            arr.view(np.uint16), TensorProto.BFLOAT16
        )
    return ort.OrtValue.ortvalue_from_numpy(arr)


class HostPlace:
    """Host numpy arrays (kept here, one placement per run) and a fresh CPU session."""

    def __init__(self):
        self._arrays: dict[int, tuple[ort.OrtValue, np.ndarray]] = {}

    def session(self, model: bytes, domain: str) -> ort.InferenceSession:
        return make_session(model, domain)

    def _wrap(self, arr: np.ndarray, onnx_type: int | None) -> ort.OrtValue:
        ov = host_ortvalue(arr, onnx_type)
        self._arrays[id(ov)] = (ov, arr)
        return ov

    def put(self, arr, onnx_type: int | None = None) -> ort.OrtValue:
        return self._wrap(np.array(arr, copy=True), onnx_type)

    def filled(self, shape, dtype, value, onnx_type: int | None = None) -> ort.OrtValue:
        return self._wrap(np.full(shape, value, np.dtype(dtype)), onnx_type)

    def get(self, ov: ort.OrtValue) -> np.ndarray:
        return self._arrays[id(ov)][1].copy()


class DevicePlace:
    """Device OrtValues and a cached session on the CUDA EP (tests/helpers/gpu_util.py)."""

    def session(self, model: bytes, domain: str) -> ort.InferenceSession:
        return cuda_session(model, domain)

    def put(self, arr, onnx_type: int | None = None) -> ort.OrtValue:
        return to_device(arr) if onnx_type is None else to_device_as(arr, onnx_type)

    def filled(self, shape, dtype, value, onnx_type: int | None = None) -> ort.OrtValue:
        return self.put(np.full(shape, value, np.dtype(dtype)), onnx_type)

    def get(self, ov: ort.OrtValue) -> np.ndarray:
        return from_device(ov)


def placement(device: str):
    """A fresh placement for one run: "cpu" (host arrays) or "cuda" (device OrtValues)."""
    return {"cpu": HostPlace, "cuda": DevicePlace}[device]()


def bind_inputs(place, sess, io, feeds: dict, cache_type: int | None = None) -> dict:
    """Binds the feeds the session takes: total_sequence_length in CPU memory, every other one
    as ``place.put`` makes it (past_key / past_value of ONNX element type ``cache_type``, None:
    their dtype's); the bound values, by name (keep them alive until the run)."""
    names = {i.name for i in sess.get_inputs()}
    bound = {}
    for k, v in feeds.items():
        if v is None or k not in names:
            continue
        if k == "total_sequence_length":
            io.bind_cpu_input(k, np.ascontiguousarray(np.asarray(v)))
            continue
        bound[k] = place.put(np.asarray(v), cache_type if k in CACHES else None)
        io.bind_ortvalue_input(k, bound[k])
    return bound


def run_bound(
    place,
    sess,
    feeds: dict,
    attrs: dict,
    case: GqaCase,
    shared: bool,
    cache_dtype,
    row: int,
    cache_type: int | None = None,
    scales: bool = False,
):
    """(output, present_key, present_value, present_key_scale, present_value_scale) as host
    arrays after one run of ``sess`` on ``feeds`` (scales None unless ``scales``: the PER_TOKEN
    scale caches). Presents of ``row`` elements of ``cache_dtype`` (numpy storage) bound as ONNX
    ``cache_type`` (None: the dtype's). Separate presents are prefilled with 0x5A bytes and
    their scale caches with NaN, the output with NaN; shared: the past buffers (and scale
    caches) are bound as the presents."""
    io = sess.io_binding()
    bound = bind_inputs(place, sess, io, feeds, cache_type)
    plan = ref.plan_step(feeds, attrs)
    q = np.asarray(feeds["query"])
    out = place.filled((case.batch, case.seq, case.num_heads * case.head_size), q.dtype, np.nan)
    io.bind_ortvalue_output("output", out)
    shape = (case.batch, case.kv_num_heads, plan.present_capacity)
    if shared:
        pk, pv = bound["past_key"], bound["past_value"]
        ks, vs = bound.get("past_key_scale"), bound.get("past_value_scale")
    else:
        fill = np.full(shape + (row,), 0x5A, np.uint8).view(cache_dtype)
        pk, pv = place.put(fill, cache_type), place.put(fill, cache_type)
        ks = place.filled(shape, np.float32, np.nan) if scales else None
        vs = place.filled(shape, np.float32, np.nan) if scales else None
    io.bind_ortvalue_output("present_key", pk)
    io.bind_ortvalue_output("present_value", pv)
    if scales:
        io.bind_ortvalue_output("present_key_scale", ks)
        io.bind_ortvalue_output("present_value_scale", vs)
    sess.run_with_iobinding(io)
    host = [place.get(out), place.get(pk).view(cache_dtype), place.get(pv).view(cache_dtype)]
    return (*host, *((place.get(ks), place.get(vs)) if scales else (None, None)))
