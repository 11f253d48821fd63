"""model/tokenizer.py's `tokenizers` backend: the ids of the package's own encode, from a path
that lets other threads run while it encodes (a server's event loop, the engine thread)."""

from __future__ import annotations

import os
import threading
import time

import pytest

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A BPE tokenizer.json trained on a few lines, with byte-level pre-tokenization."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    lines = ["The capital of France is Paris.", "héllo wörld 日本語 🙂", "hello hello hello"]
    tok.train_from_iterator(lines * 20, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return path


def test_the_ids_are_those_of_the_package_encode(model_dir):
    from ort_kvlayout.model.tokenizer import load_tokenizer

    ours = load_tokenizer(model_dir, backend="tokenizers")
    theirs = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in ("", "a", "The capital of France is", "héllo 日本語 🙂 " * 40, "\n\t  x"):
        assert ours.encode(text) == theirs.encode(text).ids
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text).ids)


def test_other_threads_run_while_a_long_text_is_encoded(model_dir):
    """A thread that counts while a long text is encoded gets to count: the encode does not
    hold the GIL throughout (the package's encode() does; encode_batch() releases it)."""
    from ort_kvlayout.model.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir, backend="tokenizers")
    text = "hello wörld " * 200_000
    ticks, done = [0], threading.Event()

    def count():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.0005)

    counter = threading.Thread(target=count)
    counter.start()
    start = time.perf_counter()
    try:
        tok.encode(text)
    finally:
        elapsed = time.perf_counter() - start
        done.set()
        counter.join()
    # a counter starved by the GIL ticks once or twice (at the switch interval's expiry at
    # best); one that runs ticks every half millisecond or so
    assert ticks[0] >= max(5, int(elapsed / 0.0005 / 20)), (ticks[0], elapsed)


def test_the_extensions_backend_loads_without_the_package_converters(model_dir, tmp_path):
    """onnxruntime-extensions' tokenizer in a fresh process that has onnx and onnxruntime: the
    same ids as `tokenizers`, without the package __init__'s converters (transformers, and the
    pure-Python protobuf it sets in os.environ for every later child process); a later import of
    the package works as it always does."""
    pytest.importorskip("onnxruntime_extensions")
    import json
    import shutil
    import subprocess
    import sys

    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer"})
    )
    script = f"""
import os, sys
import onnx, onnxruntime
from ort_kvlayout.model.tokenizer import load_tokenizer
tok = load_tokenizer({str(tmp_path)!r})
assert tok.backend == "onnxruntime-extensions", tok.backend
text = "The capital of France is Paris."
ids = tok.encode(text)
assert ids == load_tokenizer({str(tmp_path)!r}, "tokenizers").encode(text), ids
assert tok.decode(ids) == text
assert "transformers" not in sys.modules and "torch" not in sys.modules
assert "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION" not in os.environ
assert "onnxruntime_extensions" not in sys.modules
import onnxruntime_extensions
import onnxruntime_extensions.pp_api
assert [int(t) for t in onnxruntime_extensions.pp_api.Tokenizer({str(tmp_path)!r}).tokenize(text)] == ids
assert os.path.isfile(onnxruntime_extensions.get_library_path())
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
