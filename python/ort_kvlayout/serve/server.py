"""The OpenAI-compatible HTTP server (Starlette): routes over one `Engine`.

    app = build_app(engine, model_id="smollm2", tokenizer=tok, chat_template=template)
    uvicorn.run(app)        # what `ort-kvlayout serve MODEL_DIR` does (cli.py)

Routes: POST /v1/completions, POST /v1/chat/completions (stream: SSE frames `data: {...}`
separated by a blank line, ending with `data: [DONE]`), GET /v1/models, /v1/models/{id},
/health, /metrics (Prometheus text). Errors are OpenAI's JSON shape: 400 bad request or
malformed JSON, 401 a missing or wrong key (with `api_key`: every /v1/* route, and /metrics
with `metrics_key`; auth.py), 404 unknown model or route, 413 prompt (+ max_tokens) longer
than the context or the KV budget, 503 when the engine's queue is full or it is shutting down. A client that
disconnects cancels its request, which frees its slot and pages at the next engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
from collections.abc import Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .auth import RequireApiKey
from .engine import Engine, EngineClosed, EngineOverloaded, RequestTooLarge
from .openai_api import (
    ApiError,
    ParsedRequest,
    TokenFrames,
    chunk,
    load_body,
    new_id,
    parse_chat,
    parse_completion,
    response,
    sse,
    usage,
    usage_chunk,
)

__all__ = ["build_app", "load_chat_template"]

MAX_BODY_BYTES = 32 << 20
# Bodies above this are parsed (JSON, chat template, tokenizer) in a worker thread, off the event
# loop; smaller ones inline, where a thread's hand-off would only add latency.
INLINE_PARSE_BYTES = 64 << 10


def load_chat_template(model_dir: Path, tokenizer_config: dict | None = None) -> Callable | None:
    """The model's chat template (chat_template.jinja, or tokenizer_config.json's
    chat_template) as a function messages -> prompt text, rendered the way transformers does
    (a sandboxed Jinja environment, add_generation_prompt=True); None when there is none."""
    path = Path(model_dir) / "chat_template.jinja"
    config = tokenizer_config
    if config is None:
        config_path = Path(model_dir) / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (OSError, ValueError):
            config = {}
    source = path.read_text() if path.is_file() else config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)

    def token(name: str) -> str:
        value = config.get(name)
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    specials = {name: token(name) for name in ("bos_token", "eos_token", "pad_token")}

    def render(messages: list[dict]) -> str:
        return template.render(messages=messages, add_generation_prompt=True, **specials)

    return render


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _vocab_size(engine) -> int | None:
    """The model's vocabulary size where the engine tells it (a local Engine's spec, a
    cluster's vocab_size), for the request's token ids; None leaves the prompt's check to the
    engine's submit."""
    size = getattr(engine, "vocab_size", None)  # a cluster's engine: its replicas' info()
    if size is None:
        size = getattr(getattr(engine, "spec", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def build_app(
    engine: Engine,
    model_id: str,
    tokenizer=None,
    chat_template: Callable | None = None,
    on_shutdown: Callable[[], None] | None = None,
    api_key: str | None = None,
    metrics_key: bool = False,
    api_key_digest: bytes | None = None,
) -> Starlette:
    """The app over `engine`: an Engine, or an object with its capacity, closing, submit and
    stats (serve/cluster's ClusterEngine: submit is a coroutine, its handles may end with
    EngineClosed when their replica is lost, and replica_stats() stands for stats(): one
    labelled series per replica in /metrics). api_key (or its SHA-256 api_key_digest): every
    /v1/* route needs `Authorization: Bearer KEY` (and /metrics with metrics_key); /health
    stays open."""
    keyed = bool(api_key) or api_key_digest is not None
    if metrics_key and not keyed:
        raise ValueError("metrics_key needs an api_key")
    context = engine.capacity
    vocab = _vocab_size(engine)
    created = int(time.time())
    started = time.time()

    def parse(raw: bytes, chat: bool) -> ParsedRequest:
        body = load_body(raw)
        if chat:
            return parse_chat(body, tokenizer, chat_template, model_id, context, vocab)
        return parse_completion(body, tokenizer, model_id, context, vocab)

    async def read(request: Request, chat: bool) -> ParsedRequest:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        if len(raw) <= INLINE_PARSE_BYTES:
            return parse(raw, chat)
        # A large prompt's JSON and tokens take long enough to stall every other request,
        # /health and the running streams: a worker thread parses it (a tokenizer that holds
        # the GIL is bounded by openai_api's prefix encoding instead).
        return await asyncio.to_thread(parse, raw, chat)

    async def submit(req: ParsedRequest):
        try:
            handle = engine.submit(req.prompt, req.params)
            return await handle if inspect.isawaitable(handle) else handle
        except RequestTooLarge as exc:
            raise ApiError(413, str(exc), code="context_length_exceeded") from exc
        except EngineOverloaded as exc:
            raise ApiError(503, f"the server is overloaded: {exc}", "server_error") from exc
        except EngineClosed as exc:
            raise ApiError(503, str(exc), "server_error") from exc
        except ValueError as exc:  # the engine's check_request: stop strings need a tokenizer,
            # else it is the prompt (empty, or ids outside the vocabulary)
            param = "stop" if req.params.stop and tokenizer is None else "prompt"
            raise ApiError(400, str(exc), param=param) from exc
        except Exception as exc:  # a remote engine (serve/cluster) may fail in any way
            raise ApiError(500, f"the request failed: {exc}", "server_error") from exc

    async def generate(request: Request, chat: bool) -> Response:
        try:
            req = await read(request, chat)
            handle = await submit(req)
        except ApiError as exc:
            return _error(exc)
        rid = new_id(chat)
        if req.stream:
            return StreamingResponse(
                _stream(req, rid, handle), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        return await _complete(request, req, rid, handle)

    async def _complete(request: Request, req: ParsedRequest, rid: str, handle) -> Response:
        async def watch_disconnect():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    handle.cancel()
                    return

        watcher = asyncio.create_task(watch_disconnect())
        texts, last = [], None
        try:
            async for event in handle:
                if event.text:
                    texts.append(event.text)
                last = event
        except EngineClosed as exc:  # its replica was lost (a cluster's engine)
            return _error(ApiError(503, str(exc), "server_error"))
        finally:
            watcher.cancel()
            if handle.finish_reason is None:  # this task was cancelled: so is the request
                handle.cancel()
        if last is not None and last.finish_reason == "error":
            return _error(ApiError(500, f"generation failed: {last.error}", "server_error"))
        text = "".join(texts) if tokenizer is not None else ""
        u = usage(last.prompt_tokens, last.completion_tokens) if last else usage(0, 0)
        body = response(req, rid, text, last.finish_reason if last else None, u)
        if tokenizer is None or req.return_token_ids:  # without a tokenizer: the only output
            body["choices"][0]["token_ids"] = list(handle.tokens)
        return JSONResponse(body)

    async def _stream(req: ParsedRequest, rid: str, handle):
        now = int(time.time())
        ids = tokenizer is None or req.return_token_ids
        tokens = TokenFrames(req, rid, now)

        def abort(error: ApiError) -> list[bytes]:
            # finish_reason "abort" (vLLM's), then the error: a client reading either knows.
            end = None if req.chat else ""
            return [sse(chunk(req, rid, now, end, "error")), sse(error.body())]

        def frames(event) -> list[bytes]:
            if event.finish_reason == "error":
                return abort(ApiError(500, f"generation failed: {event.error}", "server_error"))
            out = []
            text = event.text if event.text is not None else ""
            if text or event.token_id is not None:
                out.append(tokens.frame(text, event.token_id if ids else None))
            if event.finished:
                out.append(sse(chunk(req, rid, now, None if req.chat else "", event.finish_reason)))
            return out

        last = None
        try:
            if req.chat:
                yield sse(chunk(req, rid, now, "", None, first=True))
            out: list[bytes] = []
            try:
                async for event in handle:
                    last = event
                    out += frames(event)
                    # A remote handle's events come in lists (`ready`: those still in hand):
                    # one write per list, not per token.
                    if not getattr(handle, "ready", 0):
                        yield b"".join(out)
                        out = []
            except EngineClosed as exc:  # its replica was lost (a cluster's engine)
                yield b"".join(out + abort(ApiError(503, str(exc), "server_error")))
                last = None  # no usage to report: the counts stopped with the replica
            if req.include_usage and last is not None:
                u = usage(last.prompt_tokens, last.completion_tokens)
                yield sse(usage_chunk(req, rid, now, u))
            yield sse("[DONE]")
        finally:
            # The client went away (the response task was cancelled) or the stream ended: a
            # request still running is cancelled, its slot and pages freed at the next step.
            if handle.finish_reason is None:
                handle.cancel()

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    def model_card() -> dict:
        return {
            "id": model_id, "object": "model", "created": created, "owned_by": "ort-kvlayout",
            "max_model_len": context,
        }  # fmt: skip

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        if request.path_params["model"] != model_id:
            name = request.path_params["model"]
            return _error(
                ApiError(404, f"The model `{name}` does not exist", code="model_not_found")
            )
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        if engine.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        uptime = time.time() - started
        if hasattr(engine, "replica_stats"):
            text = prometheus_replicas(engine.replica_stats(), model_id, uptime)
        else:
            text = prometheus(engine.stats(), model_id, uptime)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def not_found(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            return _error(
                ApiError(405, f"method {request.method} not allowed on {request.url.path}")
            )
        return _error(ApiError(exc.status_code, f"no route {request.url.path}", code="not_found"))

    middleware = []
    if keyed:
        key = Middleware(RequireApiKey, key=api_key, metrics=metrics_key, digest=api_key_digest)
        middleware.append(key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: not_found},
        lifespan=lifespan,
        middleware=middleware,
    )


# Prometheus names: (stats key, metric, type, help).
_METRICS = [
    ("running", "requests_running", "gauge", "Requests holding a slot"),
    ("waiting", "requests_waiting", "gauge", "Requests queued for a slot"),
    ("peak_running", "requests_running_peak", "gauge", "Most requests running at once"),
    ("preemptions", "preemptions_total", "counter", "Requests preempted (recomputed later)"),
    ("rejected", "requests_rejected_total", "counter", "Requests refused: queue full"),
    ("admitted", "requests_admitted_total", "counter", "Requests given a slot"),
    ("finished_stop", "requests_finished_stop_total", "counter", "Requests ended by a stop"),
    ("finished_length", "requests_finished_length_total", "counter", "Requests at max_tokens"),
    ("finished_cancelled", "requests_cancelled_total", "counter", "Requests cancelled"),
    ("finished_error", "requests_failed_total", "counter", "Requests ended by an error"),
    ("tokens", "generation_tokens_total", "counter", "Tokens generated"),
    ("prefill_tokens", "prefill_tokens_total", "counter", "Prompt tokens prefilled"),
    ("steps", "engine_steps_total", "counter", "Engine steps"),
    ("pipelined_steps", "engine_pipelined_steps_total", "counter",
     "Decode steps planned during the last step's call (EngineConfig.pipeline)"),
    ("kv_committed_bytes", "kv_committed_bytes", "gauge", "KV bytes committed now"),
    ("kv_peak_committed_bytes", "kv_committed_bytes_peak", "gauge", "Most KV bytes committed"),
    ("kv_reserved_bytes", "kv_reserved_bytes", "gauge", "KV address space reserved"),
    ("kv_budget_bytes", "kv_budget_bytes", "gauge", "KV bytes the engine may commit"),
    ("kv_bytes_moved", "kv_bytes_moved_total", "counter", "KV bytes copied by growth"),
    ("graph_captures", "graph_captures_total", "counter", "CUDA graphs captured (one per bucket)"),
    ("graph_replays", "graph_replays_total", "counter", "Calls replayed from a CUDA graph"),
    ("decode_calls", "decode_calls_total", "counter", "Decode calls"),
    ("decode_padded_rows", "decode_padded_rows_total", "counter",
     "Rows of decode calls that decode nothing (bucket padding and scratch rows)"),
    ("decode_eager_fallbacks", "decode_eager_fallbacks_total", "counter",
     "Decode calls run eagerly: the bucket's scratch rows did not fit the KV budget"),
    ("decode_buckets_used", "decode_buckets_used", "gauge", "Decode buckets run so far"),
]  # fmt: skip


def _labels(**labels) -> str:
    def escape(value) -> str:
        return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}"


def _series(series: list[tuple[str, dict]]) -> list[str]:
    """Each metric of _METRICS, one line per (labels, stats) of `series`."""
    lines = []
    for key, name, kind, text in _METRICS:
        lines += [f"# HELP ort_kvlayout_{name} {text}", f"# TYPE ort_kvlayout_{name} {kind}"]
        lines += [f"ort_kvlayout_{name}{label} {stats.get(key, 0)}" for label, stats in series]
    return lines


def _uptime(label: str, uptime: float) -> list[str]:
    return [
        "# HELP ort_kvlayout_uptime_seconds Seconds since the server started",
        "# TYPE ort_kvlayout_uptime_seconds gauge",
        f"ort_kvlayout_uptime_seconds{label} {uptime:.3f}",
    ]


def prometheus(stats: dict, model_id: str, uptime: float) -> str:
    label = _labels(model=model_id)
    return "\n".join(_series([(label, stats)]) + _uptime(label, uptime)) + "\n"


def prometheus_replicas(replicas: dict[str, dict], model_id: str, uptime: float) -> str:
    """The metrics of several engines (a cluster's replicas, by replica id, as they last
    reported), one series per replica labelled `replica`; ort_kvlayout_replicas counts them
    and ort_kvlayout_replica_info names each one's process (pid, host)."""
    series = [(_labels(model=model_id, replica=r), stats) for r, stats in sorted(replicas.items())]
    lines = _series(series)
    lines += [
        "# HELP ort_kvlayout_replicas Engine replicas running",
        "# TYPE ort_kvlayout_replicas gauge",
        f"ort_kvlayout_replicas{_labels(model=model_id)} {len(replicas)}",
        "# HELP ort_kvlayout_replica_info A replica's process",
        "# TYPE ort_kvlayout_replica_info gauge",
    ]
    for r, stats in sorted(replicas.items()):
        info = _labels(model=model_id, replica=r, pid=stats.get("pid", ""),
                       host=stats.get("host", ""))  # fmt: skip
        lines.append(f"ort_kvlayout_replica_info{info} 1")
    return "\n".join(lines + _uptime(_labels(model=model_id), uptime)) + "\n"
