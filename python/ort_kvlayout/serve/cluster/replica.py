"""One engine per Ray Serve replica: `EngineReplica`, the deployment the router balances.

    generate(prompt_ids, RequestParams) -> async generator of messages, each a list of the
        request's engine Events in columns (wire.py)

The first list comes once the request is admitted and produced its first event, so whatever
the engine refuses (RequestTooLarge, EngineOverloaded, EngineClosed, ValueError) is raised by
the caller's first read, before it answers. Later lists gather the events of
`stream_interval` seconds (the last one at once): Ray's cost is paid per message, about
0.3 ms of CPU in each process a message crosses, so a fast engine sending each token alone
would spend more on messages than on the model. Ray Serve LLM batches its streams the same way
(50 ms by default); 0 sends each step's event as it comes. A caller that stops reading (its
client went away; Ray cancels the call) cancels the request, which frees its slot and pages at
the engine's next step.

`record_routing_stats` gives Ray's controller the engine's stats (router.py routes by them and
the ingress's /metrics shows them); `check_health` fails once the engine is closed, and Ray
replaces the replica. Ray calls `__del__` once a stopping replica's requests ended (its
graceful shutdown, bounded by `graceful_shutdown_timeout_s`): the engine closes then.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from ..engine import Engine, EngineConfig, RequestParams
from .wire import pack_events

__all__ = ["EngineReplica", "engine_session_options"]


def engine_session_options(threads: int | None):
    """ORT session options with `threads` intra-op threads (None: ORT's default), never
    spinning: replicas on one machine share its cores."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    return so


def _numbers(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float))}


class EngineReplica:
    """See the module docstring. `config` is the EngineConfig's fields (a dict, so that the
    Serve config file can state them); `threads`: intra-op threads of the ORT session."""

    def __init__(
        self,
        model_dir: str,
        config: dict,
        threads: int | None = None,
        stream_interval: float = 0.05,
    ):
        from ...model.tokenizer import load_tokenizer

        model_dir = Path(model_dir)
        tokenizer = None
        if (model_dir / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(model_dir)
        self.engine = Engine(
            model_dir,
            EngineConfig(**config),
            tokenizer=tokenizer,
            session_options=engine_session_options(threads),
        )
        self.threads = threads
        self.stream_interval = stream_interval
        self.identity = {"pid": os.getpid(), "host": socket.gethostname()}
        # Bytes one token takes in a slot (all layers, K and V, PER_TOKEN scales): the router's
        # estimate of a request's need.
        self.kv_bytes_per_token = self.engine.stats()["kv_bytes_per_token"]

    def info(self) -> dict:
        """What the ingress needs to validate requests before routing them."""
        return {
            "capacity": self.engine.capacity,
            "max_batch": self.engine.max_batch,
            "vocab_size": self.engine.spec.vocab_size,
        }

    async def generate(self, prompt: list[int], params: RequestParams):
        loop = asyncio.get_running_loop()
        # submitted from this loop: the engine hands a step's events for all of this replica's
        # requests over in one call onto the loop, not one cross-thread wake-up per token
        handle = self.engine.submit(prompt, params)
        try:
            sent = None  # when the last list went
            while True:
                batch = [await handle.next_event()]
                if sent is not None and not batch[-1].finished:
                    linger = sent + self.stream_interval - loop.time()
                    if linger > 0:  # gather until the interval is up or the request ends
                        await handle.wait_end(linger)
                batch += handle.take_ready()
                yield pack_events(batch)
                sent = loop.time()
                if batch[-1].finished:
                    return
        finally:
            if handle.finish_reason is None:  # the caller went away or this task was cancelled
                handle.cancel()

    def record_routing_stats(self) -> dict:
        stats = _numbers(self.engine.stats())
        stats.update(self.identity, kv_bytes_per_token=self.kv_bytes_per_token)
        if self.threads is not None:
            stats["threads"] = self.threads
        return stats

    def check_health(self) -> None:
        if self.engine.closing:
            raise RuntimeError("the engine is closed")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(drain=False)
