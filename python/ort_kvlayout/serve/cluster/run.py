"""`ort-kvlayout serve MODEL_DIR --replicas N`: the cluster application, run until a signal.

Without `--address`, Ray starts here (a local cluster of this machine's cores and GPUs, ended
with this process); with it, the application joins that cluster, and leaving removes only the
application. SIGINT / SIGTERM drain: the application is deleted, which stops routing new
requests to its replicas and lets each replica's running requests finish for up to
--drain-timeout seconds (Ray's graceful shutdown) before the engines close.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import ray
from ray import serve

from .app import APP_NAME, ClusterOptions, build_application

__all__ = ["serve_cluster"]


def _local_resources(opts: ClusterOptions) -> None:
    """Refuses, before deploying, replicas this machine cannot place (Ray would wait forever)."""
    if opts.provider != "cuda":
        return
    gpus = ray.cluster_resources().get("GPU", 0)
    need = opts.replica_range[0] * opts.gpus_per_replica
    if need > gpus:
        raise ValueError(
            f"{opts.replica_range[0]} replicas x {opts.gpus_per_replica} GPU need {need} GPUs; "
            f"this machine has {gpus:g} (one replica per GPU, or --gpus-per-replica 0.5 to share)"
        )


def serve_cluster(opts: ClusterOptions, host: str, port: int, address: str | None,
                  api_key: str | None, log_level: str) -> int:  # fmt: skip
    """Runs the application until SIGINT/SIGTERM; 0 after a drained shutdown. Raises
    ValueError for options or a machine that cannot run it (the CLI prints it)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reporting home from a server
    # Ray starts its workers at nice 15 (its own processes first); here the workers are the
    # server (the engines, the ingress): they run at the priority this command has.
    os.environ.setdefault("RAY_worker_niceness", "0")
    app = build_application(opts, api_key)  # checks the options before Ray starts
    level = getattr(logging, log_level.upper())
    ray.init(
        address=address, include_dashboard=False, logging_level=level,
        log_to_driver=level <= logging.INFO,
    )  # fmt: skip
    # After ray.init, which installs its own SIGTERM handler (an exit, no drain).
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if address is None:
            _local_resources(opts)
        serve.start(
            http_options={"host": host, "port": port},
            logging_config={"log_level": log_level.upper()},
        )  # fmt: skip
        try:
            serve.run(app, name=APP_NAME, route_prefix="/",
                      logging_config={"log_level": log_level.upper()})  # fmt: skip
        except RuntimeError as exc:  # a replica that cannot start: Ray gave up on it
            raise ValueError(
                f"{exc} (the replicas' logs: the Ray session's logs/serve folder, "
                "/tmp/ray/session_latest/logs/serve on a local cluster)"
            ) from None
        lo, hi = opts.replica_range
        count = f"{lo}" if lo == hi else f"{lo}-{hi} (autoscaled)"
        print(
            f"serving {opts.model_id or os.path.basename(opts.model_dir.rstrip('/'))} on "
            f"http://{host}:{port}/v1 through Ray Serve: {count} engine replicas, "
            f"{opts.max_batch} slots each",
            file=sys.stderr,
            flush=True,
        )
        stop.wait()
        print("draining: running requests finish, new ones are refused", file=sys.stderr,
              flush=True)  # fmt: skip
        # The application first, while the proxies still carry its streams: its replicas
        # stop taking requests and finish theirs (graceful shutdown); then Serve itself.
        serve.delete(APP_NAME)
        if address is None:
            serve.shutdown()
    finally:
        ray.shutdown()
    return 0
