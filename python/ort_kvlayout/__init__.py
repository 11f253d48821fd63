"""ort-kvlayout: GroupQueryAttention for ONNX Runtime with a choice of KV-cache layout.

import onnxruntime as ort, ort_kvlayout
so = ort.SessionOptions()
ort_kvlayout.register(so)   # -> "ai.kvlayout"

Subpackages: ort_kvlayout.op (the library, the KV layouts, length errors: re-exported here),
ort_kvlayout.model (a model directory's files, read and checked), ort_kvlayout.tools
(patch_kv_layout, gen_inference_metadata, --verify) and ort_kvlayout.runtime (the KV cache and
generation; python -m ort_kvlayout.runtime).
"""

from .op.layout import (
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
from .op.length_errors import LengthError, check_length_error, take_length_error
from .op.library import (
    DOMAIN,
    LIBRARY_NAME,
    OP_TYPE,
    build_info,
    cuda_available,
    cudnn_status,
    library_path,
    register,
)

__version__ = "0.1.0"

__all__ = [
    "DOMAIN",
    "HEAD_MAJOR",
    "HEAD_MAJOR_BNSH",
    "LAYOUT_IDS",
    "LAYOUT_NAMES",
    "LIBRARY_NAME",
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
