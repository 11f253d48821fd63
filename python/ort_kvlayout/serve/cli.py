"""`ort-kvlayout serve [MODEL_DIR]`: the OpenAI-compatible server on a patched model directory.

    ort-kvlayout serve                      # the default model (SmolLM2-135M, seq-major) below
    ort-kvlayout serve MODEL_DIR --port 8000 --max-batch 8 --kv-budget 1GiB
    ORT_KVLAYOUT_API_KEY=... ort-kvlayout serve MODEL_DIR --host 0.0.0.0   # /v1/* need the key
    ort-kvlayout serve MODEL_DIR --replicas 2     # two engines behind one endpoint (Ray Serve)

MODEL_DIR defaults to the SmolLM2-135M seq-major model that `python scripts/main_job.py` builds
and patches into $ORT_KVLAYOUT_CACHE (default ~/.cache/ort_kvlayout)/models. Exit status: 0
after a clean shutdown (SIGINT / SIGTERM: the server stops accepting, lets running requests
finish for --drain-timeout seconds, then ends the rest with finish_reason "abort": a stream
gets its last chunk and `data: [DONE]`, a plain request its response); 2 an error before
serving (the port too: the banner is printed once the port is held), printed as one line
`error: ...` on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from .arguments import PACKING, packing_fields, parse_buckets, parse_budget, parse_bytes
from .auth import API_KEY_ENV, exposed_without_key
from .cluster.ingress_mode import INGRESS_MODES, apply_ingress, resolve_ingress
from .engine_config import CPU_PREFILL_CHUNK, CUDA_PREFILL_CHUNK
from .listen import ListenError, bind_sockets, url
from .shutdown import DRAIN_GRACE_S, EngineCloser, draining_server_class

__all__ = ["build_parser", "main", "parse_buckets", "parse_budget", "parse_bytes"]

DEFAULT_MODEL = "smollm2-135m-fp32-cpu-seq-major"


def default_model_dir() -> Path:
    root = os.environ.get("ORT_KVLAYOUT_CACHE")
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ort_kvlayout"
    return base / "models" / DEFAULT_MODEL


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e9:  # also nan, inf
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds >= 0, such as 30 or 2.5")
    return value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a TCP port is a number in [0, 65535]")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ort-kvlayout", description="ort-kvlayout serving commands"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="the OpenAI-compatible server on a model directory")
    p.add_argument("model_dir", nargs="?", help=f"model directory (default: {default_model_dir()})")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (any but loopback without a key: a warning)")  # fmt: skip
    p.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free one)")
    p.add_argument("--model-id", help="the served model id (default: the directory's name)")
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--max-batch", type=int, default=8, help="requests running at once (slots)")
    p.add_argument("--capacity", type=int, help="tokens per slot (default: the model's context)")
    p.add_argument("--kv-budget", type=parse_budget, default=(None, None),
                   help="KV memory the engine may commit: whole bytes (2GiB, 1TiB, 1e9) or a fraction "
                        "of the memory free at start (0.9, 90%%); default: 0.9 on CUDA, every slot "
                        "whole on the CPU")  # fmt: skip
    p.add_argument("--cache", choices=["growable", "preallocated"], default="growable",
                   help="preallocated: every slot committed whole (the budget buys whole slots)")  # fmt: skip
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens prefilled per step (bounds the decode stall; default: "
                        f"{CUDA_PREFILL_CHUNK} with CUDA, {CPU_PREFILL_CHUNK} on the CPU)")  # fmt: skip
    p.add_argument("--packing", choices=list(PACKING), default="auto",
                   help="a step's prefill chunks in one call computing only their tokens: auto "
                        "(where the graph allows it), off (a call per chunk), on (or an error), "
                        "mixed (the decode rows in that call too)")  # fmt: skip
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps as CUDA graphs, one per batch bucket (default: on with "
                        "--provider cuda)")  # fmt: skip
    p.add_argument("--decode-buckets", type=parse_buckets,
                   help="batch sizes decode calls are padded to, e.g. 1,2,4,8,16 (default: 1, "
                        "2, 4, multiples of 8, max-batch; with CUDA graphs)")  # fmt: skip
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests before new ones get 503")  # fmt: skip
    p.add_argument("--drain-timeout", type=_seconds, default=30.0,
                   help="seconds running requests may finish after SIGINT/SIGTERM; then the rest "
                        "end with finish_reason 'abort'")  # fmt: skip
    p.add_argument("--api-key",
                   help="every /v1/* route requires 'Authorization: Bearer KEY' (default: "
                        f"${API_KEY_ENV}, which keeps the key out of `ps`; unset: no key)")  # fmt: skip
    p.add_argument("--metrics-auth", action="store_true",
                   help="/metrics requires the key too (default: open, like /health)")  # fmt: skip
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])  # fmt: skip
    c = p.add_argument_group(
        "cluster",
        "engine replicas behind one endpoint on Ray Serve (the cluster extra: pip "
        "install 'ort-kvlayout[cluster]'); any of these options runs the cluster",
    )
    c.add_argument("--replicas", type=int, help="engine replicas (a fixed count)")
    c.add_argument("--min-replicas", type=int,
                   help="autoscaling on ongoing requests: the fewest replicas (default 1)")  # fmt: skip
    c.add_argument("--max-replicas", type=int,
                   help="autoscaling: the most replicas (default: --min-replicas)")  # fmt: skip
    c.add_argument("--target-ongoing-requests", type=float,
                   help="autoscaling: requests per replica it aims at (default: --max-batch)")  # fmt: skip
    c.add_argument("--address",
                   help="join this Ray cluster (e.g. auto, or HOST:6379) instead of starting one")  # fmt: skip
    c.add_argument("--threads", type=int,
                   help="CPU: intra-op threads per replica (default: cores // replicas)")  # fmt: skip
    c.add_argument("--stream-interval", type=float, default=0.05,
                   help="seconds a replica gathers a stream's tokens into one message after the "
                        "first (Ray's cost is per message); 0: every step's alone")  # fmt: skip
    c.add_argument("--ingress", choices=INGRESS_MODES,
                   help="how HTTP reaches the replicas of a cluster started here: haproxy "
                        "(Ray Serve's HAProxy and direct ingress; the default where an HAProxy "
                        "binary is found) or proxy (Ray's Python proxy actor); a cluster joined "
                        "with --address keeps its own")  # fmt: skip
    c.add_argument("--ingress-replicas", type=int,
                   help="HTTP ingress replicas (default: 1 on the CPU; on CUDA the engine "
                        "replicas' count, so that one Python process does not carry every "
                        "GPU's tokens)")  # fmt: skip
    c.add_argument("--gpus-per-replica", type=float, default=1.0,
                   help="CUDA: GPUs per replica (1: one per GPU; 0.5: two share one, with "
                        "--kv-budget in bytes)")  # fmt: skip
    return parser


_CLUSTER_FLAGS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
                  "address", "threads", "ingress", "ingress_replicas")  # fmt: skip


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $ORT_KVLAYOUT_API_KEY, else None. An empty key is refused rather than
    taken for "no key" (an unset secret must not open the server)."""
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ValueError("--api-key is empty")
        return args.api_key
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty (unset it to serve without a key)")
    if args.metrics_auth and key is None:
        raise ValueError(f"--metrics-auth needs a key (--api-key or ${API_KEY_ENV})")
    return key


def warn_if_exposed(host: str, key: str | None) -> None:
    if exposed_without_key(host, key):
        print(
            f"warning: serving on {host} without an API key: anyone who reaches this port can "
            f"use the model (set ${API_KEY_ENV} or --api-key)",
            file=sys.stderr,
            flush=True,
        )


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
    from . import memory
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
    try:
        api_key = resolve_api_key(args)
    except ValueError as exc:
        return _fail(exc)
    if not model_dir.exists():
        return _fail(f"MODEL_DIR {model_dir} does not exist")
    if not model_dir.is_dir():
        kind = "a file" if model_dir.is_file() else "not a directory"
        return _fail(f"MODEL_DIR {model_dir} is {kind}, not a model directory")
    if not (model_dir / "genai_config.json").is_file():
        return _fail(f"{model_dir}: no genai_config.json (not an onnxruntime-genai model folder)")
    budget_bytes, budget_fraction = args.kv_budget
    if args.provider == "cpu" and budget_bytes is not None:
        # The host's total is known before the model loads: refused at once. The device's free
        # memory (CUDA) is read once the model is loaded, by the engine.
        free, total = memory.device_memory("cpu")
        try:
            memory.resolve_kv_budget(budget_bytes, None, free, total, "cpu")
        except ValueError as exc:
            return _fail(f"--kv-budget: {exc}")
    if any(getattr(args, name) is not None for name in _CLUSTER_FLAGS):
        return serve_cluster(args, model_dir, api_key)
    try:
        import uvicorn

        from .server import build_app, load_chat_template
    except ImportError as exc:
        return _fail(f"the server needs the serve extra (pip install 'ort-kvlayout[serve]'): {exc}")
    try:  # before the model loads: a port in use is refused at once (bound again once loaded)
        for sock in bind_sockets(args.host, args.port):
            sock.close()
    except ListenError as exc:
        return _fail(exc)
    try:
        config = EngineConfig(
            max_batch=args.max_batch, capacity=args.capacity, kv_budget_bytes=budget_bytes,
            kv_budget_fraction=budget_fraction, prefill_chunk=args.prefill_chunk,
            max_waiting=args.max_waiting, provider=args.provider, cache=args.cache,
            cuda_graph=args.cuda_graph, decode_buckets=args.decode_buckets,
            **packing_fields(args.packing),
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
    close = EngineCloser(engine)
    try:  # held from here on: the banner below is printed once the port is ours
        sockets = bind_sockets(args.host, args.port)
    except ListenError as exc:
        close()
        return _fail(exc)
    model_id = args.model_id or model_dir.name
    app = build_app(
        engine, model_id, tokenizer, template, on_shutdown=close,
        api_key=api_key, metrics_key=args.metrics_auth,
    )  # fmt: skip
    server = draining_server_class()(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout + DRAIN_GRACE_S, lifespan="on",
            # asyncio's loop, not uvloop (installed with ray[serve]): uvloop writes each SSE
            # chunk to its socket holding the GIL, which the engine thread needs (docs/DECISIONS.md)
            loop="asyncio",
        ),
        drain_timeout=args.drain_timeout,
        on_drain_timeout=close,
    )  # fmt: skip
    print(
        f"serving {model_id} on {url(args.host, sockets[0].getsockname()[1])}/v1 "
        f"({engine.max_batch} slots, KV budget {engine.budget} bytes, context "
        f"{engine.capacity}, CUDA graphs {'on' if engine.config.graphs else 'off'})",
        file=sys.stderr,
        flush=True,
    )
    warn_if_exposed(args.host, api_key)
    # uvicorn handles SIGINT/SIGTERM while it serves (stop accepting, drain, shut down) and
    # raises the signal again on its way out, to the handlers installed before it: after a
    # clean shutdown that is no error, so those do nothing and the exit status is 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=sockets)
    finally:
        server.cancel_drain_timer()
        close()
        for sock in sockets:
            sock.close()
    return 0


def serve_cluster(args: argparse.Namespace, model_dir: Path, api_key: str | None) -> int:
    """The cluster side of `serve` (serve/cluster/run.py), from the same arguments."""
    if args.address is not None and args.ingress is not None:
        return _fail(
            f"--ingress {args.ingress} with --address: a joined Ray cluster's ingress is set "
            "where it started (RAY_SERVE_ENABLE_HA_PROXY in the environment of `ray start`)"
        )
    if args.address is None:  # Ray reads it as it starts: before ray is imported
        try:
            mode, note = resolve_ingress(args.ingress)
        except ValueError as exc:
            return _fail(exc)
        if note is not None:
            print(f"note: {note}", file=sys.stderr, flush=True)
        apply_ingress(mode)
    try:
        from .cluster.app import ClusterOptions
        from .cluster.run import serve_cluster as run
    except ImportError as exc:
        return _fail(
            f"--replicas needs the cluster extra (pip install 'ort-kvlayout[cluster]'): {exc}"
        )
    budget_bytes, budget_fraction = args.kv_budget
    budget = budget_bytes if budget_bytes is not None else budget_fraction
    buckets = args.decode_buckets
    try:
        opts = ClusterOptions(
            str(model_dir), model_id=args.model_id, provider=args.provider,
            max_batch=args.max_batch, capacity=args.capacity,
            kv_budget=None if budget is None else str(budget), cache=args.cache,
            prefill_chunk=args.prefill_chunk, cuda_graph=args.cuda_graph,
            decode_buckets=None if buckets is None else ",".join(map(str, buckets)),
            packing=args.packing,
            max_waiting=args.max_waiting, replicas=args.replicas or 1,
            min_replicas=args.min_replicas, max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests, threads=args.threads,
            gpus_per_replica=args.gpus_per_replica, ingress_replicas=args.ingress_replicas,
            drain_timeout=args.drain_timeout,
            stream_interval=args.stream_interval,
            metrics_auth=args.metrics_auth,
        )  # fmt: skip
        if args.replicas is not None and opts.autoscaling:
            raise ValueError("--replicas is a fixed count: give it or --min/--max-replicas")
        warn_if_exposed(args.host, api_key)
        return run(opts, args.host, args.port, args.address, api_key, args.log_level)
    except ValueError as exc:
        return _fail(exc)


if __name__ == "__main__":
    sys.exit(main())
