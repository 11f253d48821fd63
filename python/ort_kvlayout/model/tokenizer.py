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


def _pp_api():
    """onnxruntime_extensions.pp_api, without running the package's __init__ where nothing has
    run it yet. With onnx and onnxruntime installed, that __init__ imports the package's model
    converters, which import transformers (and torch, where installed: 1.8 s and 220 MB more in
    every process that loads a tokenizer: a server, each engine replica and the ingress) and set
    PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in os.environ, which every process started
    afterwards inherits. pp_api needs the package's compiled module alone. The package's module,
    made from its spec without running it, stands in sys.modules while pp_api loads and is
    removed again: a later `import onnxruntime_extensions` runs the real __init__, which finds
    the compiled module loaded (it is initialized once). Another thread importing the package
    for the first time in the same milliseconds would get the stand-in: tokenizers load as a
    process starts, before its threads serve."""
    import importlib
    import importlib.util
    import sys

    name = "onnxruntime_extensions"
    if name in sys.modules:
        return importlib.import_module(f"{name}.pp_api")
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ImportError(f"No module named {name!r}", name=name)
    sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        return importlib.import_module(f"{name}.pp_api")
    finally:
        # Left for a later import: the compiled module (initialized once), not the stand-in nor
        # a pp_api that the real package would not hold as its attribute.
        del sys.modules[name]
        sys.modules.pop(f"{name}.pp_api", None)


class ExtensionsTokenizer:
    backend = "onnxruntime-extensions"

    def __init__(self, model_dir: Path):
        self._tok = _pp_api().Tokenizer(str(model_dir))

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
