"""The engine and the server on the real SmolLM2-135M (fp32, CPU, patched seq-major).

Uses the model scripts/build_test_model.py built into the cache (skips when it is not there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    import ort_kvlayout
    from ort_kvlayout.tools.patch import patch_model_dir

    sys.path.insert(0, str(ROOT / "scripts"))
    import build_test_model

    built = build_test_model.model_dir_for("fp32", "cpu")
    if not build_test_model.is_built(built):
        pytest.skip(f"the test model is not built ({built}): python scripts/build_test_model.py")
    try:
        ort_kvlayout.library_path()
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"custom-op library not built: {exc}")
    return patch_model_dir(built, tmp_path_factory.mktemp("smollm2") / "seq").out_dir


@pytest.fixture(scope="module")
def tok(model):
    from ort_kvlayout.model.tokenizer import load_tokenizer

    return load_tokenizer(model)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_engine_equals_runtime_alone_on_smollm2(model, tok, overlap):
    from ort_kvlayout.runtime.generation import Runtime
    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    prompts = [tok.encode(p) for p in PROMPTS]
    with Runtime(model) as rt:
        alone = [rt.generate(p, TOKENS, eos_token_ids=[]).tokens[0] for p in prompts]
    # chunked prompts, a reused slot; text decoded as its token comes, or a step later
    config = EngineConfig(max_batch=2, prefill_chunk=4, overlap=overlap)
    with Engine(model, config, tokenizer=tok) as engine:
        handles = [
            engine.submit(p, RequestParams(max_tokens=TOKENS, ignore_eos=True)) for p in prompts
        ]
        texts = ["".join(e.text for e in h) for h in handles]
        stats = engine.stats()
    assert [h.tokens for h in handles] == alone
    assert texts[0].startswith(" Paris.")
    assert texts == [tok.decode(a) for a in alone]
    assert stats["kv_bytes_moved"] == 0 and stats["kv_committed_bytes"] == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_stop_string_ends_the_request_at_its_token(model, tok, overlap):
    """A request with a stop string has its text decoded as each token comes, overlapped or
    not: it ends at the token that completes the string, its text cut before it, while a
    request beside it without stop strings runs on."""
    from ort_kvlayout.runtime.generation import Runtime
    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    prompts = [tok.encode(p) for p in PROMPTS]
    with Runtime(model) as rt:
        alone = [rt.generate(p, TOKENS, eos_token_ids=[]).tokens[0] for p in prompts]
    full = tok.decode(alone[0])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full.find(stop)
    config = EngineConfig(max_batch=2, prefill_chunk=4, overlap=overlap)
    with Engine(model, config, tokenizer=tok) as engine:
        stopped = engine.submit(
            prompts[0], RequestParams(max_tokens=TOKENS, ignore_eos=True, stop=(stop,))
        )
        beside = engine.submit(prompts[1], RequestParams(max_tokens=TOKENS, ignore_eos=True))
        text = "".join(e.text for e in stopped)
        other = "".join(e.text for e in beside)
    assert stopped.finish_reason == "stop" and text == full[:cut]
    n = len(stopped.tokens)
    assert stopped.tokens == alone[0][:n] and stop in tok.decode(alone[0][:n])
    assert stop not in tok.decode(alone[0][: n - 1])  # not a step past the stop
    assert beside.tokens == alone[1] and other == tok.decode(alone[1])


def test_server_chat_stream_on_smollm2(model, tok):
    openai = pytest.importorskip("openai")
    from ort_kvlayout.runtime.generation import Runtime
    from ort_kvlayout.serve.server import load_chat_template
    from serve_util import ServerProcess

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.encode(load_chat_template(model)(messages))
    with Runtime(model) as rt:
        expected = rt.generate(prompt, 16).tokens[0]
    proc = ServerProcess(model, "--max-batch", "2").wait_ready(timeout=120)
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="seq", messages=messages, max_tokens=16, temperature=0, stream=True,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        ids, text = [], ""
        for c in stream:
            ids += c.choices[0].model_extra.get("token_ids") or []
            text += c.choices[0].delta.content or ""
    finally:
        code, _, err = proc.stop()
    assert ids == expected
    assert text == tok.decode(expected)
    assert code == 0 and "Traceback" not in err


@pytest.mark.parametrize("stop", [(), ("テキ",), ("two  sp",)])
def test_streamed_text_is_the_full_decode_up_to_the_stop_string(tok, stop):
    """Token by token through the engine's incremental detokenizer: multi-byte characters
    split over byte-level tokens, leading spaces, stop strings spanning tokens."""
    from ort_kvlayout.serve.detokenizer import IncrementalText

    prompt = tok.encode("<|im_start|>user\nSay hi<|im_end|>\n")
    generated = tok.encode(" Héllo wörld 🎉🚀 — naïve café, 日本語のテキスト!\n  two  spaces")
    text = IncrementalText(tok, len(prompt), stop)
    seq, streamed, hit = list(prompt), "", False
    for i, t in enumerate(generated):
        seq.append(t)
        delta, hit = text.delta(seq, final=i == len(generated) - 1)
        streamed += delta
        if hit:
            break
    full = tok.decode(generated)
    assert streamed == (full[: full.index(stop[0])] if stop else full)
    assert hit == bool(stop)
