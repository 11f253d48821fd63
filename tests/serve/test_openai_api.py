"""openai_api's request parsing as pure functions: each refusal is a 400 (413 for length) that
names its field, for what a client may send through JSON: lone surrogates, NaN, floats and
booleans among token ids, fields that would change the output, lax chat messages."""

from __future__ import annotations

import itertools
import json

import pytest
from ort_kvlayout.serve.openai_api import ApiError, parse_chat, parse_completion

CONTEXT = 128
VOCAB = 100


class CharTokenizer:
    """One id per character (its code point modulo VOCAB); counts its calls and their text."""

    def __init__(self):
        self.calls: list[int] = []

    def encode(self, text: str) -> list[int]:
        text.encode("utf-8")  # a lone surrogate fails here, as in the tokenizers package
        self.calls.append(len(text))
        return [ord(c) % VOCAB for c in text]


def template(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def completion(body: dict, tokenizer=None, vocab: int | None = VOCAB):
    return parse_completion(body, tokenizer or CharTokenizer(), "m", CONTEXT, vocab)


def chat(body: dict, tokenizer=None):
    return parse_chat(body, tokenizer or CharTokenizer(), template, "m", CONTEXT, VOCAB)


def refused(parse, body: dict, status: int = 400) -> ApiError:
    # Through JSON as a client sends it: json.loads makes the lone surrogates and NaNs.
    with pytest.raises(ApiError) as info:
        parse(json.loads(json.dumps(body)))
    assert info.value.status == status, info.value.message
    return info.value


def test_lone_surrogates_are_refused_naming_the_field():
    error = refused(completion, {"prompt": "\ud800abc", "max_tokens": 2})
    assert error.param == "prompt"
    assert error.message == "'prompt' is not valid Unicode text (a lone surrogate at index 0)"
    assert refused(completion, {"prompt": ["\ud800abc"], "stream": True}).param == "prompt"
    error = refused(chat, {"messages": [{"role": "user", "content": "\udfffhi"}]})
    assert error.param == "messages[0].content" and "lone surrogate at index 0" in error.message
    parts = [{"type": "text", "text": "ok"}, {"type": "text", "text": "a\udc00"}]
    error = refused(chat, {"messages": [{"role": "user", "content": parts}]})
    assert error.param == "messages[0].content[1].text" and "index 1" in error.message
    error = refused(chat, {"messages": [{"role": "\ud800", "content": "hi"}]})
    assert error.param == "messages[0].role"
    error = refused(completion, {"prompt": "abc", "stop": ["x", "y\ud800"]})
    assert error.param == "stop" and "'stop[1]' is not valid Unicode" in error.message
    assert refused(completion, {"prompt": "abc", "stop": "\ud800"}).param == "stop"
    # A valid pair (an astral character) is fine.
    assert completion({"prompt": "a\U0001f600"}).prompt == [97 % VOCAB, 0x1F600 % VOCAB]


@pytest.mark.parametrize("prompt", [[1.5], [True], [1, 2.0], [1, None], [1, "a"], [[1.5]]])
def test_prompt_token_ids_must_be_integers(prompt):
    error = refused(completion, {"prompt": prompt})
    assert error.param == "prompt" and "token ids must be integers" in error.message


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], ["a", [1]]])
def test_one_prompt_per_request(prompt):
    error = refused(completion, {"prompt": prompt})
    assert error.param == "prompt" and error.message == "one prompt per request is supported"


def test_token_ids_outside_the_vocabulary():
    error = refused(completion, {"prompt": [1, VOCAB]})
    assert error.param == "prompt" and f"[0, {VOCAB})" in error.message
    assert refused(completion, {"prompt": [-1]}).param == "prompt"
    error = refused(completion, {"prompt": "abc", "stop_token_ids": [99999999]})
    assert error.param == "stop_token_ids" and "99999999" in error.message
    assert refused(completion, {"prompt": "abc", "stop_token_ids": [-2]}).param == "stop_token_ids"
    ok = completion({"prompt": [1, VOCAB - 1], "stop_token_ids": [VOCAB - 1]})
    assert ok.prompt == [1, VOCAB - 1] and ok.params.stop_token_ids == (VOCAB - 1,)
    # Without the vocabulary (an engine that does not tell it), the engine checks the prompt.
    assert completion({"prompt": [VOCAB]}, vocab=None).prompt == [VOCAB]


@pytest.mark.parametrize(
    "key", ["temperature", "top_p", "top_k", "seed", "max_tokens", "n", "presence_penalty"]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_numbers_must_be_finite(key, value):
    error = refused(completion, {"prompt": "abc", key: value})
    assert error.param == key and f"'{key}' must be a finite number" in error.message


def test_range_messages_read_as_rules():
    error = refused(completion, {"prompt": "abc", "max_tokens": 0})
    assert error.param == "max_tokens" and error.message == "'max_tokens' must be >= 1, got 0"
    error = refused(completion, {"prompt": "abc", "temperature": 3})
    assert error.message == "'temperature' must be in [0.0, 2.0], got 3.0"
    assert refused(completion, {"prompt": "abc", "top_k": -2}).message == (
        "'top_k' must be >= -1, got -2"
    )
    error = refused(completion, {"prompt": "abc", "temperature": 10**400})
    assert error.param == "temperature" and "too large" in error.message


@pytest.mark.parametrize("model", [5, ["m"], {"id": "m"}, True])
def test_model_must_be_a_string(model):
    error = refused(completion, {"prompt": "abc", "model": model})
    assert error.param == "model" and error.message.startswith("'model' must be a string")
    assert refused(completion, {"prompt": "abc", "model": "other"}, 404).code == "model_not_found"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("response_format", "json"),
        ("suffix", "tail"),
        ("logprobs", 0),
        ("logprobs", 1),
        ("logprobs", True),
        ("functions", [{"name": "f"}]),
    ],
)
def test_completion_fields_that_change_the_output_are_refused(field, value):
    error = refused(completion, {"prompt": "abc", field: value})
    assert error.param == field and "not supported" in error.message


@pytest.mark.parametrize(
    ("field", "value"),
    [("response_format", {"type": "json_object"}), ("logprobs", True), ("logprobs", 0)],
)
def test_chat_fields_that_change_the_output_are_refused(field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    assert refused(chat, body).param == field


def test_default_values_of_refused_fields_are_accepted():
    defaults = {"response_format": {"type": "text"}, "suffix": "", "logprobs": None}
    assert completion({"prompt": "abc", **defaults}).prompt
    assert completion({"prompt": "abc", "suffix": None, "some_future_field": [1]}).prompt
    messages = [{"role": "user", "content": "hi"}]
    assert chat({"messages": messages, "logprobs": False, "response_format": {"type": "text"}})
    assert chat({"messages": messages, "suffix": "ignored: not a chat field"})


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user"}, "messages[0].content"),
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "system", "content": []}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "messages[0].content[0]"),
        ({"role": "user", "content": 5}, "messages[0].content"),
        ({"role": "wizard", "content": "hi"}, "messages[0].role"),
        ({"role": "tool", "content": "hi"}, "messages[0].role"),
        ({"content": "hi"}, "messages[0].role"),
        ("hi", "messages[0]"),
    ],
)
def test_chat_messages_are_checked(message, param):
    error = refused(chat, {"messages": [message]})
    assert error.param == param, error.message
    assert error.message.startswith(f"'{param}")


def test_chat_roles_and_contents_accepted():
    tok = CharTokenizer()
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]},
        {"role": "assistant", "content": None},
        {"role": "assistant"},
        {"role": "user", "content": ""},
    ]  # fmt: skip
    req = chat({"messages": messages}, tok)
    # developer -> system: chat templates know only system.
    text = "system: Be brief.\nuser: Hi you\nassistant: \nassistant: \nuser: \nassistant:"
    assert req.prompt == tok.encode(text)


def test_an_overlong_prompt_is_refused_from_a_prefix():
    tok = CharTokenizer()
    error = refused(lambda body: completion(body, tok), {"prompt": "hello " * 100_000}, 413)
    assert error.param == "prompt" and error.code == "context_length_exceeded"
    assert tok.calls == [16 * CONTEXT]  # one prefix, not the 600 000 characters
    # A prompt shorter than the prefix is encoded whole, and its 413 counts its tokens.
    tok = CharTokenizer()
    error = refused(lambda body: completion(body, tok), {"prompt": "x" * (CONTEXT + 5)}, 413)
    assert tok.calls == [CONTEXT + 5] and f"has {CONTEXT + 5} tokens" in error.message
    messages = [{"role": "user", "content": "hello " * 100_000}]
    assert refused(chat, {"messages": messages}, 413).param == "messages"


def test_a_long_text_of_few_tokens_is_encoded_whole():
    class Words(CharTokenizer):  # one token a word: 6 characters a token
        def encode(self, text):
            self.calls.append(len(text))
            return [1] * len(text.split())

    tok = Words()
    long = ("x" * 40 + " ") * (CONTEXT - 8)  # 41 characters a token, over 16 * CONTEXT in all
    assert len(completion({"prompt": long, "max_tokens": 1}, tok).prompt) == CONTEXT - 8
    assert tok.calls[-1] == len(long) and len(tok.calls) > 1


def test_token_frames_equal_the_chunk_encoded_whole():
    from ort_kvlayout.serve.engine import RequestParams
    from ort_kvlayout.serve.openai_api import ParsedRequest, TokenFrames, chunk, sse

    texts = ["", " hello", 'a "quote"', "back\\slash", "line\nbreak", "é", "\u2028", "🙂", "\ue000"]
    models = ["tiny", 'mo"del', "\ue000text\ue000"]  # the last holds the marker: the slow path
    for chat, usage, model in itertools.product((False, True), (False, True), models):
        req = ParsedRequest([1], RequestParams(), True, usage, chat, model)
        frames = TokenFrames(req, "cmpl-7", 1765000000)
        for text, token in itertools.product(texts, (None, 0, 42, -7_340_033)):
            body = chunk(req, "cmpl-7", 1765000000, text, None)
            if token is not None:
                body["choices"][0]["token_ids"] = [token]
            assert frames.frame(text, token) == sse(body), (chat, usage, model, text, token)
        templated = {k: v is not None for k, v in frames._parts.items()}
        assert templated == {False: model != models[-1], True: model != models[-1]}
