"""The copy of libort_kvlayout.so that ONNX Runtime loaded into this process, for the C functions
it exports beside RegisterCustomOps (csrc/ort/exports.map).

``ctypes`` opens the library file with ``RTLD_NOLOAD``, which returns the copy the process already
has (the dynamic loader matches the file, not only the path) and never loads a second one: a
second copy would have its own, empty, state (no op instances, no cuDNN graphs). When the
library is not loaded, no op ran, so there is nothing to read. A patched model directory may
carry its own copy (genai_config.json's custom_ops_library): pass that path to read the copy
its sessions loaded. Found handles are kept (which also keeps the library loaded); a lookup that
finds nothing is repeated at the next call, so it costs a path resolution and a dlopen attempt
each time: a caller that calls every step (the generation runtime) looks up once a session
exists.
"""

from __future__ import annotations

import ctypes
import os

_handles: dict[str, ctypes.CDLL] = {}


def loaded_library(path: str | os.PathLike | None = None) -> ctypes.CDLL | None:
    """The loaded library (the package's copy, or the one at `path`), or None when ONNX Runtime
    has not loaded it in this process."""
    key = os.fspath(path) if path is not None else ""
    handle = _handles.get(key)
    if handle is not None:
        return handle
    if path is None:
        from . import library_path

        try:
            path = library_path()
        except FileNotFoundError:
            return None
    try:
        handle = ctypes.CDLL(os.fspath(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError:
        return None
    _handles[key] = handle
    return handle


def string_function(name: str, path: str | os.PathLike | None = None):
    """The exported ``size_t name(char* buffer, size_t size)`` of the loaded library, or None
    (library not loaded, or a build without that function, e.g. without CUDA)."""
    lib = loaded_library(path)
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is not None and fn.restype is not ctypes.c_size_t:  # CDLL keeps the object: once
        fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        fn.restype = ctypes.c_size_t
    return fn


def call_string_function(fn, size: int = 4096) -> tuple[int, str]:
    """(returned length, text) of a ``string_function``."""
    buf = ctypes.create_string_buffer(size)
    n = fn(buf, size)
    return n, buf.value.decode("utf-8", errors="replace")
