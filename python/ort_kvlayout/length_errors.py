"""Length values the CUDA op found invalid on the device, read from Python.

On CUDA, ``seqlens_k``, ``query_seqlens`` and ``position_ids`` live in device memory, so the op
checks them in its prepare kernel, which records the first violation into host-mapped memory
(docs/CONTRACT.md, "Length values on CUDA"). The node's next Run fails with the CPU op's
message; a CUDA graph replay runs no host code of the op, so the record is also readable here.

How the call reaches the record: ``libort_kvlayout.so`` (the library ONNX Runtime loads through
``register_custom_ops_library``) exports ``OrtKvlayoutTakeLengthError``. ``ctypes`` opens the
same file with ``RTLD_NOLOAD``, which returns the copy the process already has (the dynamic
loader matches the file, not only the path) and never loads a second one: a second copy would
have its own, empty, list of op instances. When the library is not loaded, no op instance
exists, so there is nothing to report. The handle is kept, which also keeps the library loaded.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["LengthError", "check_length_error", "take_length_error"]

_SYMBOL = "OrtKvlayoutTakeLengthError"
_MESSAGE_BYTES = 4096
_take = None  # the bound C function, once the library is found loaded


class LengthError(RuntimeError):
    """A length value (seqlens_k, query_seqlens, position_ids) the op found invalid on the
    device; the message is the CPU op's for the same value."""


def _take_function():
    global _take
    if _take is not None:
        return _take
    from . import library_path

    try:
        path = library_path()
    except FileNotFoundError:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError:  # not loaded in this process: no op instance, nothing recorded
        return None
    fn = getattr(lib, _SYMBOL)  # AttributeError: a library older than this package
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_size_t
    _take = fn
    return fn


def take_length_error() -> str | None:
    """The first length violation recorded on the device by any ai.kvlayout CUDA node of this
    process since the last take (the earliest-created node holding one), or None; clears every
    node's record. It does not synchronize: call it once the step's work is done (e.g. after
    its outputs were copied to the host). None on a build without CUDA, and whenever the
    library is not loaded."""
    fn = _take_function()
    if fn is None:
        return None
    buf = ctypes.create_string_buffer(_MESSAGE_BYTES)
    if fn(buf, _MESSAGE_BYTES) == 0:
        return None
    return buf.value.decode("utf-8", errors="replace")


def check_length_error(where: str = "") -> None:
    """Raises LengthError with the recorded message (prefixed by ``where``) if there is one."""
    message = take_length_error()
    if message is not None:
        raise LengthError(f"{where}: {message}" if where else message)
