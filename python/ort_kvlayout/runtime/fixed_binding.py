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

The runtime's decode step (runtime/generation.py) and the serving engine's per-bucket decode
calls (serve/executor.py) are both made of one.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnxruntime as ort

from .kv_cache import KvBuffer, bind_in_place

__all__ = ["FixedBinding"]


class FixedBinding:
    """See the module docstring. The arrays passed in are kept (not copied): `host[name]` is
    the array to edit before upload()."""

    def __init__(
        self,
        session: ort.InferenceSession,
        device: str,
        device_id: int,
        kv_buffers: list[KvBuffer],
        inputs: dict[str, np.ndarray],
        outputs: dict[str, np.ndarray],
        host_inputs: dict[str, np.ndarray] | None = None,
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
            self._bind_host(self.binding.bind_input, name, array)
        self._device: dict[str, ort.OrtValue] = {}
        if device == "cpu":
            for name, array in self.host.items():
                self._bind_host(self.binding.bind_input, name, array)
            for name, array in self._outputs.items():
                self._bind_host(self.binding.bind_output, name, array)
            return
        for name, array in (*self.host.items(), *self._outputs.items()):
            self._device[name] = ort.OrtValue.ortvalue_from_numpy(array, "cuda", device_id)
        for name in self.host:
            self.binding.bind_ortvalue_input(name, self._device[name])
        for name in self._outputs:
            self.binding.bind_ortvalue_output(name, self._device[name])

    @staticmethod
    def _bind_host(bind, name: str, array: np.ndarray) -> None:
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}: a fixed binding needs a C-contiguous array")
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def upload(self, names: Iterable[str]) -> None:
        """Copies the named host inputs to their device addresses (CUDA; on the CPU the bound
        arrays are the inputs, nothing to do)."""
        if self._device:
            for name in names:
                self._device[name].update_inplace(self.host[name])

    def read(self, name: str) -> np.ndarray:
        """An output on the host: on the CPU the bound array itself (valid until the next run),
        on CUDA a copy."""
        if self.device == "cpu":
            return self._outputs[name]
        return self._device[name].numpy()
