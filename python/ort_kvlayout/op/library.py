"""The custom-op library: where its file is, registering it with a session, what it was built
with, and the copy ONNX Runtime loaded into this process.

``loaded_library`` reads the C functions the library exports beside RegisterCustomOps
(csrc/ort/exports.map). ``ctypes`` opens the library file with ``RTLD_NOLOAD``, which returns the
copy the process already has (the dynamic loader matches the file, not only the path) and never
loads a second one: a second copy would have its own, empty, state (no op instances, no cuDNN
graphs). When the library is not loaded, no op ran, so there is nothing to read. A patched model
directory may carry its own copy (genai_config.json's custom_ops_library): pass that path to read
the copy its sessions loaded. Found handles are kept (which also keeps the library loaded); a
lookup that finds nothing is repeated at the next call, so it costs a path resolution and a
dlopen attempt each time: a caller that calls every step (the generation runtime) looks up once a
session exists.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

DOMAIN = "ai.kvlayout"
OP_TYPE = "GroupQueryAttention"
LIBRARY_NAME = "libort_kvlayout.so"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # ort_kvlayout/


def library_path() -> str:
    """Absolute path of the custom-op library (no Python dependency; any ORT host can load it)."""
    candidates = [_PACKAGE_DIR / LIBRARY_NAME]
    try:  # editable installs keep compiled files beside _C, away from the sources
        from .. import _C

        candidates.append(Path(_C.__file__).resolve().parent / LIBRARY_NAME)
    except ImportError:
        pass
    for path in candidates:
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        f"{LIBRARY_NAME} not found in {', '.join(str(p.parent) for p in candidates)}; "
        "reinstall ort-kvlayout (pip install .)"
    )


# The SessionOptions config entry that records the library registered with them: ONNX Runtime
# refuses a second registration of the domain at session creation ("Domain already set in
# registry"), far from the call that made it.
_REGISTERED = "ort_kvlayout.custom_ops_library"


def register(session_options: Any) -> str:
    """Registers the custom-op library with an onnxruntime.SessionOptions; returns DOMAIN.
    Idempotent: options that already hold it (register() again, then a Runtime or an Engine
    given the same options) are left as they are."""
    register_library(session_options, library_path())
    return DOMAIN


def registered_library(session_options: Any) -> str | None:
    """The library file register() / register_library() registered with these options, or
    None."""
    try:
        return session_options.get_session_config_entry(_REGISTERED)
    except RuntimeError:  # no such entry: nothing registered through this module
        return None


def register_library(session_options: Any, path: str | os.PathLike) -> None:
    """Registers the library file `path` once per SessionOptions. TypeError for anything but
    onnxruntime.SessionOptions; ValueError when they already hold another copy of the library
    (one library per domain and session: the two would clash)."""
    import onnxruntime

    if not isinstance(session_options, onnxruntime.SessionOptions):
        raise TypeError(
            f"expected onnxruntime.SessionOptions, got {type(session_options).__name__}"
        )
    path = str(Path(path).resolve())
    held = registered_library(session_options)
    if held == path:
        return
    if held is not None:
        raise ValueError(
            f"these SessionOptions already registered the op library {held}; registering "
            f"{path} too would clash (one {DOMAIN} library per session): use new SessionOptions"
        )
    session_options.register_custom_ops_library(path)
    session_options.add_session_config_entry(_REGISTERED, path)


def build_info() -> dict[str, Any]:
    """Version, ORT header API version and CUDA architectures the library was built with, and
    its CPU kernel levels: ``cpu_isas`` (built, e.g. ``["portable", "avx2", "avx512"]``),
    ``cpu_isa_best`` (the highest this CPU supports), ``cpu_isa`` (the one in use, chosen once
    per process; ``ORT_KVLAYOUT_CPU_ISA`` forces a lower one) and ``cpu_isa_error`` (why a
    forced level was refused, then ``cpu_isa`` is None and every CPU kernel call fails)."""
    from .. import _C

    return dict(_C.build_info())


def cuda_available() -> bool:
    """True when the library has CUDA kernels and onnxruntime offers CUDAExecutionProvider."""
    if not build_info().get("cuda"):
        return False
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def cudnn_status() -> str | None:
    """How cuDNN's fused attention serves CUDA prefill in this process: "cuDNN <version>: graphs
    built B, refused R, launches L", or why it does not ("unavailable (...)", "not built (...)");
    None before ONNX Runtime loaded the library, or for a build without CUDA. ORT_KVLAYOUT_CUDNN=0
    keeps prefill on the library's own kernels."""
    fn = string_function("OrtKvlayoutCudnnStatus")
    return None if fn is None else call_string_function(fn)[1]


_handles: dict[str, ctypes.CDLL] = {}


def loaded_library(path: str | os.PathLike | None = None) -> ctypes.CDLL | None:
    """The loaded library (the package's copy, or the one at `path`), or None when ONNX Runtime
    has not loaded it in this process."""
    key = os.fspath(path) if path is not None else ""
    handle = _handles.get(key)
    if handle is not None:
        return handle
    if path is None:
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


_buffers = threading.local()  # a thread's reply buffers by size: the engine asks every step


def call_string_function(fn, size: int = 4096) -> tuple[int, str]:
    """(returned length, text) of a ``string_function`` (text "" when it wrote nothing)."""
    kept = getattr(_buffers, "by_size", None)
    if kept is None:
        kept = _buffers.by_size = {}
    buf = kept.get(size)
    if buf is None:
        buf = kept[size] = ctypes.create_string_buffer(size)
    n = fn(buf, size)
    if n == 0:
        return 0, ""
    return n, buf.value.decode("utf-8", errors="replace")
