"""Text <-> token ids for a model directory, without transformers.

    tok = load_tokenizer(model_dir)        # tokenizer.json (+ tokenizer_config.json)
    ids = tok.encode("The capital of France is"); text = tok.decode(ids)

Backends, in order: onnxruntime-extensions (the C++ tokenizer onnxruntime-genai itself uses,
reading the directory's tokenizer.json and tokenizer_config.json), then the `tokenizers` package
(tokenizer.json alone) when extensions is missing or refuses the directory. Both are in the
`runtime` extra. `backend=` forces one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

BACKENDS = ("onnxruntime-extensions", "tokenizers")


class Tokenizer(Protocol):
    backend: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ExtensionsTokenizer:
    backend = "onnxruntime-extensions"

    def __init__(self, model_dir: Path):
        from onnxruntime_extensions import pp_api

        self._tok = pp_api.Tokenizer(str(model_dir))

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tok.tokenize(text)]

    def decode(self, ids: list[int]) -> str:
        out = self._tok.detokenize([int(t) for t in ids])
        return out if isinstance(out, str) else "".join(out)


class HfTokenizer:
    backend = "tokenizers"

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it encodes (encode holds it): a server thread
        # tokenizing a long prompt leaves the event loop and the engine thread running. Same ids.
        return list(self._tok.encode_batch([text])[0].ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=True)


class TokenizerBackendMissing(RuntimeError):
    """No tokenizer backend is installed (as opposed to one that refused the tokenizer)."""


def load_tokenizer(model_dir: str | os.PathLike, backend: str | None = None) -> Tokenizer:
    """The directory's tokenizer through the first backend that loads it (see the docstring)."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer.json not found in {model_dir}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"tokenizer backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    errors = []
    for name, cls in (("onnxruntime-extensions", ExtensionsTokenizer), ("tokenizers", HfTokenizer)):
        if backend is not None and name != backend:
            continue
        try:
            return cls(model_dir)
        except ImportError as exc:
            errors.append(f"{name}: not installed ({exc})")
        except Exception as exc:  # noqa: BLE001 -- a backend refusing this tokenizer: try the next
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    details = "; ".join(" ".join(e.split()) for e in errors)  # one line, whatever the backends say
    if all(": not installed (" in e for e in errors):
        raise TokenizerBackendMissing(
            f"no tokenizer backend is installed to read {model_dir / 'tokenizer.json'} "
            f"(pip install ort-kvlayout[runtime]): {details}"
        )
    raise RuntimeError(
        f"no tokenizer backend could load {model_dir / 'tokenizer.json'} "
        f"(pip install ort-kvlayout[runtime]): {details}"
    )
