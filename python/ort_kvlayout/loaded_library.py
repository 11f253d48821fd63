"""The copy of libort_kvlayout.so that ONNX Runtime loaded into this process, for the C functions
it exports beside RegisterCustomOps (csrc/ort/exports.map).

``ctypes`` opens the library file with ``RTLD_NOLOAD``, which returns the copy the process already
has (the dynamic loader matches the file, not only the path) and never loads a second one: a
second copy would have its own, empty, state (no op instances, no cuDNN graphs). When the
library is not loaded, no op ran, so there is nothing to read. The handle is kept, which also
keeps the library loaded.
"""

from __future__ import annotations

import ctypes
import os

_handle: ctypes.CDLL | None = None


def loaded_library() -> ctypes.CDLL | None:
    """The loaded library, or None when ONNX Runtime has not loaded it in this process."""
    global _handle
    if _handle is not None:
        return _handle
    from . import library_path

    try:
        path = library_path()
    except FileNotFoundError:
        return None
    try:
        _handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError:
        return None
    return _handle


def string_function(name: str):
    """The exported ``size_t name(char* buffer, size_t size)`` of the loaded library, or None
    (library not loaded, or a build without that function, e.g. without CUDA)."""
    lib = loaded_library()
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is not None:
        fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        fn.restype = ctypes.c_size_t
    return fn


def call_string_function(fn, size: int = 4096) -> tuple[int, str]:
    """(returned length, text) of a ``string_function``."""
    buf = ctypes.create_string_buffer(size)
    n = fn(buf, size)
    return n, buf.value.decode("utf-8", errors="replace")
