"""`ort-kvlayout serve [MODEL_DIR]`: the OpenAI-compatible server on a patched model directory.

    ort-kvlayout serve                      # the default model (SmolLM2-135M, seq-major) below
    ort-kvlayout serve MODEL_DIR --port 8000 --max-batch 8 --kv-budget 1GiB

MODEL_DIR defaults to the SmolLM2-135M seq-major model that `python scripts/main_job.py` builds
and patches into $ORT_KVLAYOUT_CACHE (default ~/.cache/ort_kvlayout)/models. Exit status: 0
after a clean shutdown (SIGINT / SIGTERM: the server stops accepting, lets running requests
finish for --drain-timeout seconds, cancels the rest); 2 an error before serving, printed as
one line `error: ...` on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-fp32-cpu-seq-major"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}  # fmt: skip


def default_model_dir() -> Path:
    root = os.environ.get("ORT_KVLAYOUT_CACHE")
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ort_kvlayout"
    return base / "models" / DEFAULT_MODEL


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes such as 512MiB, 2GiB, 1e9")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ort-kvlayout", description="ort-kvlayout serving commands"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="the OpenAI-compatible server on a model directory")
    p.add_argument("model_dir", nargs="?", help=f"model directory (default: {default_model_dir()})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-id", help="the served model id (default: the directory's name)")
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--max-batch", type=int, default=8, help="requests running at once (slots)")
    p.add_argument("--capacity", type=int, help="tokens per slot (default: the model's context)")
    p.add_argument("--kv-budget", type=parse_bytes,
                   help="KV bytes the engine may commit, e.g. 2GiB (default: all slots whole)")  # fmt: skip
    p.add_argument("--cache", choices=["growable", "preallocated"], default="growable",
                   help="preallocated: every slot committed whole (the budget buys whole slots)")  # fmt: skip
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled per step (bounds the decode stall)")  # fmt: skip
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests before new ones get 503")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests may finish after SIGINT/SIGTERM")  # fmt: skip
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])  # fmt: skip
    return parser


def _fail(message: str) -> int:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A signal while the model loads ends the process quietly (uvicorn installs its own
    # handlers once it serves).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return serve(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stderr went away: nobody to tell
        with contextlib.suppress(OSError):
            sys.stderr.close()
        return 1


def serve(args: argparse.Namespace) -> int:
    from ..model.config import MetadataError
    from ..model.tokenizer import load_tokenizer
    from .engine import Engine, EngineConfig

    if args.model_dir is None:
        model_dir = default_model_dir()
        if not (model_dir / "genai_config.json").is_file():
            return _fail(
                f"no MODEL_DIR given and the default model {model_dir} is not built: run "
                "`python scripts/main_job.py` (builds SmolLM2-135M and patches it) or pass a "
                "patched model directory"
            )
    else:
        if not args.model_dir.strip():
            return _fail("MODEL_DIR is empty")
        model_dir = Path(args.model_dir).expanduser()
    model_dir = model_dir.resolve()  # a library the config names is loaded from here, never PATH
    if not (model_dir / "genai_config.json").is_file():
        return _fail(f"{model_dir}: no genai_config.json (not an onnxruntime-genai model folder)")
    memory = physical_memory()
    if args.provider == "cpu" and args.kv_budget and memory and args.kv_budget > memory:
        return _fail(
            f"--kv-budget {args.kv_budget} bytes is more than this machine's memory ({memory} "
            "bytes)"
        )
    try:
        import uvicorn

        from .server import build_app, load_chat_template
    except ImportError as exc:
        return _fail(f"the server needs the serve extra (pip install 'ort-kvlayout[serve]'): {exc}")
    try:
        config = EngineConfig(
            max_batch=args.max_batch, capacity=args.capacity, kv_budget_bytes=args.kv_budget,
            prefill_chunk=args.prefill_chunk, max_waiting=args.max_waiting,
            provider=args.provider, cache=args.cache,
        )  # fmt: skip
        tokenizer = None
        if (model_dir / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(model_dir)
        tokenizer_config = {}
        if (model_dir / "tokenizer_config.json").is_file():
            tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
        template = load_chat_template(model_dir, tokenizer_config)
        engine = Engine(model_dir, config, tokenizer=tokenizer)
    except (MetadataError, ValueError, OSError, RuntimeError, MemoryError) as exc:
        return _fail(exc)
    except Exception as exc:  # noqa: BLE001 -- onnxruntime's own exception types
        return _fail(f"{type(exc).__name__}: {exc}")
    model_id = args.model_id or model_dir.name
    app = build_app(
        engine, model_id, tokenizer, template, on_shutdown=lambda: engine.close(drain=False)
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout, lifespan="on",
        )
    )  # fmt: skip
    print(
        f"serving {model_id} on http://{args.host}:{args.port}/v1 ({args.max_batch} slots, "
        f"KV budget {engine.budget} bytes, context {engine.capacity})",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn handles SIGINT/SIGTERM while it serves (stop accepting, drain, shut down) and
    # raises the signal again on its way out, to the handlers installed before it: after a
    # clean shutdown that is no error, so those do nothing and the exit status is 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.close(drain=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
