"""Length values the CUDA op found invalid on the device, read from Python.

On CUDA, ``seqlens_k``, ``query_seqlens`` and ``position_ids`` live in device memory, so the op
checks them in its prepare/decode kernel, which records the first violation into host-mapped memory
(docs/CONTRACT.md, "Length values on CUDA"). The node's next Run fails with the CPU op's
message; a CUDA graph replay runs no host code of the op, so the record is also readable here.

How the call reaches the record: ``libort_kvlayout.so`` exports ``OrtKvlayoutTakeLengthError``,
called on the copy ONNX Runtime loaded (library.py). When the library is not loaded, no op
instance exists, so there is nothing to report.
"""

from __future__ import annotations

import os

from .library import call_string_function, string_function

__all__ = ["LengthError", "check_length_error", "take_length_error"]

_SYMBOL = "OrtKvlayoutTakeLengthError"
_MESSAGE_BYTES = 4096


class LengthError(RuntimeError):
    """A length value (seqlens_k, query_seqlens, position_ids) the op found invalid on the
    device; the message is the CPU op's for the same value."""


def take_length_error(library: str | os.PathLike | None = None) -> str | None:
    """The first length violation recorded on the device by any ai.kvlayout CUDA node of this
    process since the last take (the earliest-created node holding one), or None; clears every
    node's record. It does not synchronize: call it once the step's work is done (e.g. after
    its outputs were copied to the host). None on a build without CUDA, and whenever the
    library is not loaded. `library`: the copy the sessions registered when it is not the
    package's (a patched model directory's libort_kvlayout.so)."""
    fn = string_function(_SYMBOL, library)
    if fn is None:
        return None
    n, message = call_string_function(fn, _MESSAGE_BYTES)
    return message if n > 0 else None


def check_length_error(where: str = "", library: str | os.PathLike | None = None) -> None:
    """Raises LengthError with the recorded message (prefixed by ``where``) if there is one."""
    message = take_length_error(library)
    if message is not None:
        raise LengthError(f"{where}: {message}" if where else message)
