"""The server's shutdown: running requests get --drain-timeout seconds, then end with
finish_reason "abort" while their responses can still be written.

    close = EngineCloser(engine)                     # closes it once, whoever calls first
    server = draining_server_class()(uvicorn.Config(app, ...,
        timeout_graceful_shutdown=drain_timeout + DRAIN_GRACE_S),
        drain_timeout=drain_timeout, on_drain_timeout=close)
"""

from __future__ import annotations

import threading

__all__ = ["DRAIN_GRACE_S", "EngineCloser", "draining_server_class"]

# Seconds uvicorn's own graceful shutdown waits beyond --drain-timeout: the time the requests
# cancelled at the drain deadline have to send their last chunk (its timeout cancels the
# response tasks instead: a cut stream and a traceback per request).
DRAIN_GRACE_S = 5.0


class EngineCloser:
    """Closes the engine once, whoever comes first: the drain deadline (a timer thread), the
    app's shutdown, or the way out of serve(). A later call waits for that close to end."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._engine.close(drain=False)


def draining_server_class():
    """uvicorn.Server with the drain deadline (uvicorn is imported on call: the serve extra)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's Server whose shutdown gives the running requests `drain_timeout` seconds,
        then ends the rest itself (`on_drain_timeout`: the engine's close, finish_reason
        "cancelled", "abort" on the wire) while their responses can still be written: uvicorn's
        own timeout (timeout_graceful_shutdown, set a few seconds longer) would cancel the
        response tasks instead (a stream cut without its last chunk, a 500, a traceback)."""

        def __init__(self, config, drain_timeout: float, on_drain_timeout) -> None:
            super().__init__(config)
            self._drain_timeout = drain_timeout
            self._on_drain_timeout = on_drain_timeout
            self._timer: threading.Timer | None = None

        async def shutdown(self, sockets=None) -> None:
            # Called once the main loop saw the signal (never from the signal handler itself).
            if self._timer is None:
                self._timer = threading.Timer(self._drain_timeout, self._on_drain_timeout)
                self._timer.name = "ort-kvlayout-drain-timeout"
                self._timer.daemon = True
                self._timer.start()
            await super().shutdown(sockets=sockets)

        def cancel_drain_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()

    return DrainingServer
