"""OpenAI request bodies -> engine requests, engine events -> OpenAI response bodies.

Pure functions, no web framework: server.py wires them to HTTP. Unknown request fields are
ignored (clients and benchmark tools send extensions); fields whose non-default values the
engine cannot honour (n > 1, echo, logprobs, response_format, suffix, penalties) are a 400
naming the field, as is text that is not valid Unicode (a lone surrogate). Extensions honoured:
ignore_eos, top_k, stop_token_ids, return_token_ids. Chat roles: system, developer (rendered as
system), user, assistant.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..runtime.sampling import SamplingParams
from .requests import RequestParams

__all__ = ["ApiError", "ParsedRequest", "parse_chat", "parse_completion"]


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, param and code."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",  # OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code,
        )  # fmt: skip

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}


@dataclass
class ParsedRequest:
    prompt: list[int]
    params: RequestParams
    stream: bool
    include_usage: bool
    chat: bool
    model: str
    return_token_ids: bool = False  # an extension (vLLM's name): choices carry token_ids


def load_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _show(value) -> str:
    """A client's value in a message: as JSON (NaN, null, "text"), cut short."""
    return json.dumps(value)[:40]


def _rule(low, high) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f">= {low}" if low is not None else f"<= {high}"


def _number(body: dict, key: str, default, kind=float, low=None, high=None):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{key}' must be a number, got {_show(value)}", param=key)
    if isinstance(value, float) and not math.isfinite(value):  # json.loads takes NaN, Infinity
        raise ApiError(400, f"'{key}' must be a finite number, got {_show(value)}", param=key)
    if kind is int and value != int(value):
        raise ApiError(400, f"'{key}' must be an integer, got {value}", param=key)
    try:
        value = kind(value)
    except OverflowError:  # an integer beyond a float's range
        raise ApiError(400, f"'{key}' is too large, got {_show(value)}", param=key) from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"'{key}' must be {_rule(low, high)}, got {value}", param=key)
    return value


def _text(text: str, name: str, param: str) -> str:
    """text, refused if it is not valid Unicode: a JSON escape such as \\ud800 decodes to a lone
    surrogate, which no tokenizer takes (the tokenizers package raises TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            400, f"'{name}' is not valid Unicode text (a lone surrogate at index {exc.start})",
            param=param,
        ) from None  # fmt: skip
    return text


def _text_format(response_format) -> bool:
    return response_format is None or (
        isinstance(response_format, dict) and response_format.get("type") == "text"
    )


def _unsupported(body: dict, chat: bool) -> None:
    if _number(body, "n", 1, int) != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    logprobs = body.get("logprobs")
    refused = {
        "echo": bool(body.get("echo")),
        # Completions' logprobs is a count, where 0 still asks for the chosen token's logprob;
        # chat's is a boolean, false the default.
        "logprobs": logprobs is not None and (not chat or logprobs is not False),
        "top_logprobs": body.get("top_logprobs") not in (None, 0),
        "best_of": body.get("best_of") not in (None, 1),
        "logit_bias": bool(body.get("logit_bias")),
        "tools": bool(body.get("tools")),
        "functions": bool(body.get("functions")),
        "response_format": not _text_format(body.get("response_format")),
        "suffix": not chat and bool(body.get("suffix")),
    }
    for key, bad in refused.items():
        if bad:
            raise ApiError(400, f"'{key}' is not supported by this server", param=key)
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        default = 1.0 if key == "repetition_penalty" else 0.0
        if _number(body, key, default) != default:
            raise ApiError(400, f"'{key}' is not supported by this server", param=key)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    single = isinstance(stop, str)
    if single:
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > 16:
        raise ApiError(400, "'stop' takes at most 16 strings", param="stop")
    names = ["stop"] if single else [f"stop[{i}]" for i in range(len(stop))]
    return tuple(_text(s, name, "stop") for s, name in zip(stop, names))


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_vocab(ids: list[int], key: str, vocab: int | None) -> None:
    """Token ids inside [0, vocab); with vocab None (unknown here) the engine checks the prompt's
    upper bound, and negative ids are refused all the same."""
    bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        bounds = f"[0, {vocab})" if vocab is not None else "(>= 0)"
        raise ApiError(
            400, f"'{key}' has token ids outside the vocabulary {bounds}: {bad[:5]}", param=key
        )


def _token_ids(value, key: str, vocab: int | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_id(t) for t in value):
        raise ApiError(400, f"'{key}' must be a list of integers", param=key)
    _in_vocab(value, key, vocab)
    return tuple(value)


def _params(
    body: dict, prompt_len: int, context: int, default_max: int | None, chat: bool,
    vocab: int | None,
) -> RequestParams:  # fmt: skip
    _unsupported(body, chat)
    if prompt_len >= context:
        raise ApiError(
            413,
            f"the prompt has {prompt_len} tokens; this model's context is {context} tokens",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, default_max, int, 1)
    if max_tokens is None:
        max_tokens = context - prompt_len
    if prompt_len + max_tokens - 1 > context:
        raise ApiError(
            413,
            f"{prompt_len} prompt tokens + {key} {max_tokens} exceed this model's context of "
            f"{context} tokens",
            param=key,
            code="context_length_exceeded",
        )
    temperature = _number(body, "temperature", 1.0, float, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, float, 0.0, 1.0)
    top_k = _number(body, "top_k", 0, int, -1)
    seed = _number(body, "seed", None, int)
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_k=max(top_k, 0),
            top_p=top_p if top_p > 0 else 1e-9,
            seed=None if seed is None else seed & (2**63 - 1),
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    ignore_eos = _flag(body, "ignore_eos")
    return RequestParams(
        max_tokens=max_tokens,
        sampling=sampling,
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids", vocab),
        stop=_stop(body),
        ignore_eos=ignore_eos,
    )


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be a boolean", param=key)
    return value


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return stream, bool(options.get("include_usage", False))


def _model(body: dict, served: str) -> str:
    model = body.get("model")
    if model is None:
        return served
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {_show(model)}", param="model")
    if model != served:
        raise ApiError(
            404,
            f"The model `{model}` does not exist (this server serves `{served}`)",
            param="model",
            code="model_not_found",
        )
    return model


def _encode(tokenizer, text: str, context: int, param: str) -> list[int]:
    """text's token ids. A text far beyond the context costs seconds of a core to encode whole
    (a 12 MB prompt), and some tokenizers hold the GIL while they encode, so a text longer than
    16 characters a context token is first encoded by growing prefixes: one that already makes
    twice the context in tokens is a 413 without the rest. Twice, as a cut can split a word into
    more tokens than it makes whole."""
    size = 16 * context
    while size < len(text):
        ids = tokenizer.encode(text[:size])
        if len(ids) >= 2 * context:
            raise ApiError(
                413,
                f"the prompt has over {context} tokens (its first {size} characters make "
                f"{len(ids)}); this model's context is {context} tokens",
                param=param,
                code="context_length_exceeded",
            )
        size *= 4
    return tokenizer.encode(text)


def _prompt(body: dict, tokenizer, context: int, vocab: int | None) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as token ids")
        return _encode(tokenizer, _text(prompt, "prompt", "prompt"), context, "prompt")
    if not isinstance(prompt, list):
        raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")
    if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "one prompt per request is supported", param="prompt")
    bad = [t for t in prompt if not _is_id(t)]
    if bad:
        raise ApiError(
            400, f"'prompt' token ids must be integers, got {_show(bad[0])}", param="prompt"
        )
    _in_vocab(prompt, "prompt", vocab)
    return list(prompt)


def parse_completion(
    body: dict, tokenizer, served: str, context: int, vocab: int | None = None
) -> ParsedRequest:
    """vocab: the model's vocabulary size, for the token ids' check (None: the engine's)."""
    model = _model(body, served)
    ids = _prompt(body, tokenizer, context, vocab)
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    stream, usage = _stream_flags(body)
    params = _params(body, len(ids), context, 16, False, vocab)
    return ParsedRequest(ids, params, stream, usage, False, model, _flag(body, "return_token_ids"))


# OpenAI's roles that a chat template can render; tool and function messages need tools.
ROLES = ("system", "developer", "user", "assistant")


def _text_part(part, name: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise ApiError(
            400, f"'{name}' must be a text part: only text content is supported", param=name
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise ApiError(400, f"'{name}.text' must be a string", param=f"{name}.text")
    return _text(text, f"{name}.text", f"{name}.text")


def _content(content, name: str, optional: bool) -> str:
    """A message's text: a string, or text parts joined; null only where optional (an assistant
    message, whose content OpenAI allows to be absent)."""
    if content is None and optional:
        return ""
    if isinstance(content, list) and content:
        return "".join(_text_part(part, f"{name}[{j}]") for j, part in enumerate(content))
    if not isinstance(content, str):
        rule = "a string or a non-empty list of text parts" + (", or null" if optional else "")
        raise ApiError(400, f"'{name}' must be {rule}", param=name)
    return _text(content, name, name)


def _message(message, i: int) -> dict:
    name = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"'{name}' must be an object", param=name)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(
            400, f"'{name}.role' must be one of {', '.join(ROLES)}, got {_show(role)}",
            param=f"{name}.role",
        )  # fmt: skip
    content = _content(message.get("content"), f"{name}.content", role == "assistant")
    # A developer message is the system prompt of OpenAI's newer models; templates know only
    # "system" (and SmolLM2's adds its default system prompt beside any other role).
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(
    body: dict, tokenizer, template, served: str, context: int, vocab: int | None = None
) -> ParsedRequest:
    model = _model(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    if tokenizer is None or template is None:
        raise ApiError(400, "this model has no tokenizer or chat template: use /v1/completions")
    try:
        text = template(clean)
    except Exception as exc:  # the template's own raise_exception, or a bug in it
        raise ApiError(400, f"the chat template refused the messages: {exc}") from exc
    ids = _encode(tokenizer, text, context, "messages")
    if not ids:
        raise ApiError(400, "the messages encode to no tokens", param="messages")
    stream, usage = _stream_flags(body)
    params = _params(body, len(ids), context, None, True, vocab)
    return ParsedRequest(ids, params, stream, usage, True, model, _flag(body, "return_token_ids"))


# ---------------------------------------------------------------------------------------------
# Responses


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str | None) -> str | None:
    return {"cancelled": "abort", "error": "abort"}.get(reason, reason) if reason else None


def response(req: ParsedRequest, rid: str, text: str, reason: str | None, u: dict) -> dict:
    created = int(time.time())
    if req.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason(reason),
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason(reason),
        }
        obj = "text_completion"
    return {
        "id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
        "usage": u,
    }  # fmt: skip


def chunk(req: ParsedRequest, rid: str, created: int, text: str | None, reason: str | None,
          first: bool = False) -> dict:  # fmt: skip
    if req.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason(reason),
        }  # fmt: skip
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0, "text": text or "", "logprobs": None,
            "finish_reason": finish_reason(reason),
        }  # fmt: skip
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        body["usage"] = None
    return body


def usage_chunk(req: ParsedRequest, rid: str, created: int, u: dict) -> dict:
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": u}  # fmt: skip


def sse(body: dict | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


_TEXT_MARK = "\ue000text\ue000"  # a private-use string: encoded as \ue000 escapes, unique
_ID_MARK = -7_340_033  # never a token id


class TokenFrames:
    """The SSE frame of a streamed token: `frame(text, token_id)` is byte for byte
    sse(chunk(req, rid, created, text, None)), with `token_ids: [token_id]` in its choice when
    token_id is not None, but only the text (and id) are encoded per token: the rest of the
    chunk is encoded once a request, from a chunk holding markers (a dict's json.dumps cost
    about 5 us a token, on the engine's process's GIL)."""

    def __init__(self, req: ParsedRequest, rid: str, created: int):
        self._req, self._rid, self._created = req, rid, created
        self._parts: dict[bool, tuple[bytes, ...] | None] = {}

    def _template(self, with_id: bool) -> tuple[bytes, ...] | None:
        body = chunk(self._req, self._rid, self._created, _TEXT_MARK, None)
        if with_id:
            body["choices"][0]["token_ids"] = [_ID_MARK]
        encoded = sse(body)
        text = json.dumps(_TEXT_MARK).encode()
        number = str(_ID_MARK).encode()
        if encoded.count(text) != 1 or encoded.count(number) != int(with_id):
            return None  # a marker elsewhere (in the model's name): the dict every time
        head, tail = encoded.split(text)
        return (head, *tail.split(number)) if with_id else (head, tail)

    def frame(self, text: str, token_id: int | None = None) -> bytes:
        with_id = token_id is not None
        if with_id not in self._parts:
            self._parts[with_id] = self._template(with_id)
        parts = self._parts[with_id]
        if parts is None:
            body = chunk(self._req, self._rid, self._created, text, None)
            if with_id:
                body["choices"][0]["token_ids"] = [token_id]
            return sse(body)
        encoded = json.dumps(text).encode()
        if with_id:
            return b"".join((parts[0], encoded, parts[1], str(int(token_id)).encode(), parts[2]))
        return b"".join((parts[0], encoded, parts[1]))
