"""An IOBinding that never moves: what a captured CUDA graph replays.

    fixed = FixedBinding(session, "cuda", 0, kv_buffers,
                         inputs={"input_ids": ids}, outputs={"logits": logits},
                         host_inputs={"total_sequence_length": total})
    fixed.host["input_ids"][:, 0] = ...     # edit the host array
    fixed.upload(["input_ids"])             # CUDA: copied to the same device address
    session.run_with_iobinding(fixed.binding, run_options)
    fixed.read("logits")                    # the output (on the CPU: the bound array itself)

A CUDA graph records the addresses and shapes of every input and output, so a binding that
is replayed keeps them for its life: the KV buffers bound in place (the cache's addresses never
move), and every other input and output at one address with one shape. On CUDA those are device
OrtValues made once from the host arrays and updated in place; on the CPU the host arrays
themselves, bound by pointer (nothing to copy). `host_inputs` stay in CPU memory on either
device (an input the op reads on the host, such as GQA's total_sequence_length).

On CUDA the small inputs (ids, positions, lengths, sampling parameters: ARENA_LIMIT bytes or
less each) share one device buffer, each bound at its own offset, so that an upload of any of
them is one host-to-device copy a step instead of one per input (each ORT update_inplace is a
synchronous copy and tens of microseconds on the decode's critical path). Larger inputs (the
model's own graph's mask) keep a buffer of their own.

The runtime's decode step (runtime/generation.py) and the serving engine's per-bucket decode
calls (serve/executor.py) are both made of one.

An eager call, whose inputs change shape from call to call, takes its device inputs through a
CallUpload instead: bind_cpu_input copies each input to the device when it is bound (ORT's
IOBinding::BindInput, a synchronous copy an input), where CallUpload lays them out in one host
buffer, copies it once into a device buffer kept for calls of that size class, and binds each
input by pointer at its offset.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import numpy as np
import onnxruntime as ort

from .kv_cache import KvBuffer, bind_in_place

__all__ = ["ARENA_LIMIT", "CallUpload", "FixedBinding", "arena_layout", "bind_host_array"]

ARENA_LIMIT = 64 * 1024  # bytes: an input this size or smaller is uploaded through the arena
_ALIGN = 256  # bytes: each input's offset in the arena (cudaMalloc's own alignment)


def bind_host_array(bind, name: str, array: np.ndarray) -> None:
    """Binds a host array by pointer (`bind`: an IOBinding's bind_input or bind_output): ORT
    reads or writes the array itself, which must outlive the call."""
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: binding by pointer needs a C-contiguous array")
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


def arena_layout(arrays: dict[str, np.ndarray], limit: int = ARENA_LIMIT) -> tuple[dict, int]:
    """({name: byte offset}, arena bytes) for the arrays of `limit` bytes or less, each at an
    offset aligned to _ALIGN, in the order given."""
    offsets, end = {}, 0
    for name, array in arrays.items():
        if array.nbytes <= limit:
            offsets[name] = end
            end += -(-max(array.nbytes, 1) // _ALIGN) * _ALIGN
    return offsets, end


class FixedBinding:
    """See the module docstring. The arrays passed in are kept (not copied): `host[name]` is
    the array to edit before upload(). An output given as an OrtValue (CUDA) is bound as it
    is, so that bindings that never run at once may share one (on the CPU: the same array).
    `device_inputs` (CUDA) binds an input at an OrtValue's address with the shape given (its
    bytes, read as that shape): another binding's output, so that one call's output is the
    next one's input without leaving the device (on the CPU: a view of that output's array,
    given in `inputs`); upload() never copies it."""

    def __init__(
        self,
        session: ort.InferenceSession,
        device: str,
        device_id: int,
        kv_buffers: list[KvBuffer],
        inputs: dict[str, np.ndarray],
        outputs: dict[str, np.ndarray],
        host_inputs: dict[str, np.ndarray] | None = None,
        device_inputs: dict[str, tuple[ort.OrtValue, tuple[int, ...]]] | None = None,
    ):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r}: expected 'cpu' or 'cuda'")
        self.device = device
        self.host = dict(inputs)
        self._outputs = dict(outputs)
        self._pinned = dict(host_inputs or {})  # kept alive: bound by pointer
        self.binding = session.io_binding()
        bind_in_place(self.binding, kv_buffers)
        for name, array in self._pinned.items():
            bind_host_array(self.binding.bind_input, name, array)
        self._device: dict[str, ort.OrtValue] = {}
        self._aliased: dict[str, ort.OrtValue] = {}  # CUDA: device_inputs, never uploaded
        self._in_arena: dict[str, np.ndarray] = {}  # CUDA: each small input's bytes in the arena
        if device == "cpu":
            for name, array in self.host.items():
                bind_host_array(self.binding.bind_input, name, array)
            for name, array in self._outputs.items():
                bind_host_array(self.binding.bind_output, name, array)
            return
        offsets, size = arena_layout(self.host)
        self._arena_host = np.zeros(size, np.uint8)
        for name, at in offsets.items():
            array = self.host[name]
            view = self._arena_host[at : at + array.nbytes].view(array.dtype).reshape(array.shape)
            view[...] = array
            self._in_arena[name] = view
        self._arena = None
        if size:
            self._arena = ort.OrtValue.ortvalue_from_numpy(self._arena_host, "cuda", device_id)
            base = self._arena.data_ptr()
            for name, at in offsets.items():
                array = self.host[name]
                self.binding.bind_input(
                    name, "cuda", device_id, array.dtype, list(array.shape), base + at
                )
        for name, array in self.host.items():
            if name not in offsets:  # a buffer of its own
                self._device[name] = ort.OrtValue.ortvalue_from_numpy(array, "cuda", device_id)
                self.binding.bind_ortvalue_input(name, self._device[name])
        for name, (value, shape) in (device_inputs or {}).items():
            self._aliased[name] = value
            self.binding.bind_input(
                name, "cuda", device_id, value.element_type(), list(shape), value.data_ptr()
            )
        for name, array in self._outputs.items():
            if isinstance(array, ort.OrtValue):  # a device output shared with other bindings
                self._device[name] = array
            else:
                self._device[name] = ort.OrtValue.ortvalue_from_numpy(array, "cuda", device_id)
            self.binding.bind_ortvalue_output(name, self._device[name])

    def upload(self, names: Iterable[str]) -> None:
        """Copies the named host inputs to their device addresses (CUDA; on the CPU the bound
        arrays are the inputs, nothing to do)."""
        if self.device == "cpu":
            return
        arena = False
        for name in names:
            view = self._in_arena.get(name)
            if view is not None:
                view[...] = self.host[name]
                arena = True
            else:
                self._device[name].update_inplace(self.host[name])
        if arena:  # one copy for every small input (the others' bytes as last uploaded)
            self._arena.update_inplace(self._arena_host)

    def read(self, name: str) -> np.ndarray:
        """An output on the host: on the CPU the bound array itself (valid until the next run),
        on CUDA a copy."""
        if self.device == "cpu":
            return self._outputs[name]
        return self._device[name].numpy()


class CallUpload:
    """See the module docstring: an eager call's device inputs in one copy (CUDA). Its device
    buffers are sized in powers of two and kept, so that no call allocates; a call's inputs stay
    valid until the next bind() of the same size class (the caller's Run has ended by then)."""

    def __init__(self, device_id: int):
        self.device_id = device_id
        self._buffers: dict[int, tuple[np.ndarray, ort.OrtValue]] = {}
        self.uploads = 0  # copies made (one a bind)

    def bind(self, binding: ort.IOBinding, arrays: dict[str, np.ndarray]) -> None:
        """Uploads `arrays` in one copy and binds each as the input of its name."""
        offsets, size = arena_layout(arrays, limit=sys.maxsize)
        size_class = 1 << (max(size, _ALIGN) - 1).bit_length()
        held = self._buffers.get(size_class)
        if held is None:
            host = np.zeros(size_class, np.uint8)
            held = host, ort.OrtValue.ortvalue_from_numpy(host, "cuda", self.device_id)
            self._buffers[size_class] = held
        host, device = held
        for name, at in offsets.items():
            array = np.ascontiguousarray(arrays[name])
            host[at : at + array.nbytes] = array.reshape(-1).view(np.uint8)
        device.update_inplace(host)
        self.uploads += 1
        base = device.data_ptr()
        for name, at in offsets.items():
            array = arrays[name]
            binding.bind_input(
                name, "cuda", self.device_id, array.dtype, list(array.shape), base + at
            )
