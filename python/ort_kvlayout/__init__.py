"""ort-kvlayout: GroupQueryAttention for ONNX Runtime with a choice of KV-cache layout.

import onnxruntime as ort, ort_kvlayout
so = ort.SessionOptions()
ort_kvlayout.register(so)   # -> "ai.kvlayout"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .layout import (
    HEAD_MAJOR,
    HEAD_MAJOR_BNSH,
    LAYOUT_IDS,
    LAYOUT_NAMES,
    SEQ_MAJOR,
    SEQ_MAJOR_BSNH,
    KvStrides,
    from_layout,
    kv_strides,
    layout_id,
    to_layout,
)
from .length_errors import LengthError, check_length_error, take_length_error

__version__ = "0.1.0"
DOMAIN = "ai.kvlayout"
OP_TYPE = "GroupQueryAttention"
LIBRARY_NAME = "libort_kvlayout.so"

__all__ = [
    "DOMAIN",
    "HEAD_MAJOR",
    "HEAD_MAJOR_BNSH",
    "LAYOUT_IDS",
    "LAYOUT_NAMES",
    "OP_TYPE",
    "SEQ_MAJOR",
    "SEQ_MAJOR_BSNH",
    "KvStrides",
    "LengthError",
    "__version__",
    "build_info",
    "check_length_error",
    "cuda_available",
    "cudnn_status",
    "from_layout",
    "kv_strides",
    "layout_id",
    "library_path",
    "register",
    "take_length_error",
    "to_layout",
]


def library_path() -> str:
    """Absolute path of the custom-op library (no Python dependency; any ORT host can load it)."""
    here = Path(__file__).resolve().parent
    candidates = [here / LIBRARY_NAME]
    try:  # editable installs keep compiled files beside _C, away from the sources
        from . import _C

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


def register(session_options: Any) -> str:
    """Registers the custom-op library with an onnxruntime.SessionOptions; returns DOMAIN."""
    session_options.register_custom_ops_library(library_path())
    return DOMAIN


def build_info() -> dict[str, Any]:
    """Version, ORT header API version and CUDA architectures the library was built with, and
    its CPU kernel levels: ``cpu_isas`` (built, e.g. ``["portable", "avx2", "avx512"]``),
    ``cpu_isa_best`` (the highest this CPU supports), ``cpu_isa`` (the one in use, chosen once
    per process; ``ORT_KVLAYOUT_CPU_ISA`` forces a lower one) and ``cpu_isa_error`` (why a
    forced level was refused, then ``cpu_isa`` is None and every CPU kernel call fails)."""
    from . import _C

    return dict(_C.build_info())


def cudnn_status() -> str | None:
    """How cuDNN's fused attention serves CUDA prefill in this process: "cuDNN <version>: graphs
    built B, refused R, launches L", or why it does not ("unavailable (...)", "not built (...)");
    None before ONNX Runtime loaded the library, or for a build without CUDA. ORT_KVLAYOUT_CUDNN=0
    keeps prefill on the library's own kernels."""
    from .loaded_library import call_string_function, string_function

    fn = string_function("OrtKvlayoutCudnnStatus")
    return None if fn is None else call_string_function(fn)[1]


def cuda_available() -> bool:
    """True when the library has CUDA kernels and onnxruntime offers CUDAExecutionProvider."""
    if not build_info().get("cuda"):
        return False
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()
