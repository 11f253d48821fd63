"""The server's listening sockets, bound before it says it serves.

    sockets = bind_sockets("127.0.0.1", 8000)   # ListenError: "cannot listen on ...: address
    uvicorn.Server(config).run(sockets=sockets)  #   already in use" (one line, for the CLI)

`ort-kvlayout serve` binds its port itself and hands the sockets to uvicorn, so that its
"serving ... on URL" line is printed only once the port is held, and a port in use is an error
line and exit status 2 rather than uvicorn's log line after the banner.
"""

from __future__ import annotations

import socket

__all__ = ["ListenError", "bind_sockets", "url"]


class ListenError(OSError):
    """The address cannot be listened on: its message is the whole story."""


def url(host: str, port: int) -> str:
    """http://host:port, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets on every address `host` names (as asyncio's create_server binds
    them: SO_REUSEADDR, an IPv6 socket IPv6 only), for uvicorn's `run(sockets=...)`. With port
    0 every address gets the port the first one was given. ListenError: one line naming the
    address and the reason (address already in use, permission denied, unknown host)."""
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ListenError(f"cannot listen on {where}: {reason[:1].lower()}{reason[1:]}") from None
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[:2]) in seen:
                continue
            seen.add((family, address[:2]))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
                sock.listen(2048)
            except OSError as exc:
                shown = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                reason = exc.strerror or str(exc)
                raise ListenError(
                    f"cannot listen on {shown}:{address[1]}: {reason[:1].lower()}{reason[1:]}"
                ) from None
            sock.set_inheritable(True)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise ListenError(f"cannot listen on {where}: no address")
    return sockets
