"""This process's request routers, by deployment: how /metrics reads the stats they route by.

A module of its own because Ray Serve ships the router's module to each process by value
(cloudpickle): state kept there would be a copy per unpickling, not one table.
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["register", "router_for"]

_routers: dict[tuple[str, str], weakref.ReferenceType] = {}
_lock = threading.Lock()


def register(app_name: str, deployment: str, router) -> None:
    with _lock:
        _routers[(app_name, deployment)] = weakref.ref(router)


def router_for(app_name: str, deployment: str):
    """This process's router of `deployment` in `app_name`, once a handle created it."""
    with _lock:
        ref = _routers.get((app_name, deployment))
    return ref() if ref is not None else None
