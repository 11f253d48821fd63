"""The engine replicas seen from the ingress as one engine: what server.build_app serves.

    engine = ClusterEngine(handle, info)    # handle: the EngineReplica deployment's
    app = build_app(engine, model_id, tokenizer, template)    # the single server's app

`submit` (a coroutine here) sends `generate(prompt, params)` through the deployment handle, so
Ray's request router picks the replica (router.py), and returns once the replica produced the
request's first event: a refusal (413, 503 queue full, 400) or a replica lost before the first
token is raised then, before the HTTP response starts. A replica lost later ends the request's
iteration with ReplicaLost (an EngineClosed: the server ends the stream with finish_reason
"abort" and an error frame, or answers 503). `replica_stats()` labels /metrics by replica.
"""

from __future__ import annotations

import collections

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
)

from ..requests import EngineClosed, EngineOverloaded, Event, RequestParams
from .registry import router_for
from .wire import unpack_events

__all__ = ["ClusterEngine", "RemoteHandle", "ReplicaLost"]

# Ray's errors for a replica that died or cannot be reached.
_LOST = (RayActorError, ActorUnavailableError, ReplicaUnavailableError, DeploymentUnavailableError)


class ReplicaLost(EngineClosed):
    """The replica that ran a request died or cannot be reached (Ray restarts it)."""


def _lost(exc: BaseException) -> ReplicaLost:
    return ReplicaLost(f"the replica serving this request was lost ({type(exc).__name__})")


class RemoteHandle:
    """A request running on a replica, read like the engine's RequestHandle: `async for`
    its events; cancel() ends it (Ray cancels the replica's call, which cancels the
    request there); tokens and finish_reason as it goes."""

    def __init__(self, stream, first: list[Event]):
        self._stream = stream
        self._pending = collections.deque(first)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    @property
    def ready(self) -> int:
        """Events received and not yet read (the server writes them out together)."""
        return len(self._pending)

    def cancel(self) -> None:
        if self.finish_reason is None:
            self._stream.cancel()

    async def __aiter__(self):
        while self.finish_reason is None:
            if not self._pending:
                try:
                    self._pending.extend(unpack_events(await self._stream.__anext__()))
                except StopAsyncIteration:
                    raise ReplicaLost("the replica ended the request's stream early") from None
                except RequestCancelledError:
                    self.finish_reason = "cancelled"
                    return
                except _LOST as exc:
                    raise _lost(exc) from exc
                continue
            event = self._pending.popleft()
            if event.token_id is not None:
                self.tokens.append(event.token_id)
            if event.finished:
                self.finish_reason = event.finish_reason
            yield event


class ClusterEngine:
    """Engine's surface for server.build_app (capacity, closing, submit; replica_stats in place
    of stats), over the replicas of one EngineReplica deployment. `info`: a replica's info()
    (capacity, vocab_size)."""

    def __init__(self, handle, info: dict):
        self._handle = handle.options(stream=True)
        self._app, self._deployment = handle.app_name, handle.deployment_name
        self.capacity = int(info["capacity"])
        vocab = info.get("vocab_size")
        self.vocab_size = int(vocab) if vocab is not None else None  # requests' token ids
        self.closing = False

    async def submit(self, prompt: list[int], params: RequestParams) -> RemoteHandle:
        stream = self._handle.generate.remote(prompt, params)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise ReplicaLost("the replica ended the request's stream before its first event")
        except BackPressureError as exc:
            raise EngineOverloaded(str(exc)) from exc
        except _LOST as exc:
            raise _lost(exc) from exc
        except RayTaskError as exc:  # the engine refused it: its own exception, not Ray's wrap
            if isinstance(exc.cause, Exception):
                raise exc.cause from None
            raise
        return RemoteHandle(stream, unpack_events(first))

    def replica_stats(self) -> dict[str, dict]:
        """Each running replica's last reported stats, by replica id."""
        router = router_for(self._app, self._deployment)
        if router is None:
            return {}
        # The router's own thread replaces its replica table as replicas come and go: a copy
        # taken while it changes is taken again.
        for _ in range(5):
            try:
                replicas = list(router.curr_replicas.items())
                break
            except RuntimeError:  # changed size during iteration
                continue
        else:
            return {}
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in replicas}
