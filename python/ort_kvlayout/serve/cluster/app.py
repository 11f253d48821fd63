"""The Ray Serve application: an OpenAI ingress in front of N engine replicas.

    app = build_application(ClusterOptions(model_dir, replicas=2))     # what the CLI runs
    serve run docs/cluster.yaml         # the same through `build` (import_path ...app:build)

Deployments:
* `EngineReplica` (replica.py): one engine each. `replicas` fixed, or autoscaled between
  `min_replicas` and `max_replicas` on ongoing requests (Ray's autoscaling_config, with
  `target_ongoing_requests` = `max_batch` unless given: a replica whose slots are all busy is at
  target, one with waiting requests above it). Routed by KvLoadRouter (router.py).
  CPU: each replica runs `threads` intra-op threads (default: the cores here divided among the
  most replicas it may run) and asks Ray for as many CPUs (a share of the cores when they do
  not go round). CUDA: `gpus_per_replica` GPUs each (1: one replica per GPU; 0.5: two share
  one, which then needs `kv_budget` in bytes). `max_ongoing_requests` is the engine's slots
  plus its queue plus one, so that the engine, not Ray, answers the request past its queue
  (503, as the single server does).
* `OpenAIIngress` (ingress.py): server.py's app over the replicas; the API key reaches it as a
  SHA-256 digest (`ORT_KVLAYOUT_API_KEY` where the application is built). `ingress_replicas`
  of it: by default one on the CPU, where every process shares the replicas' cores, and on CUDA
  as many as the most engine replicas, so that no single Python process carries the tokens of
  every GPU (Ray Serve LLM autoscales its ingress on ongoing requests). HAProxy, or Ray's
  proxy, spreads the connections over them; each routes to any engine replica.

Ray's defaults stand where not said: autoscaling's `upscale_delay_s` 30 s and
`downscale_delay_s` 600 s, health checks every 10 s, a dead replica restarted by the controller.
"""

from __future__ import annotations

import dataclasses
import os
from argparse import ArgumentTypeError
from dataclasses import dataclass
from pathlib import Path

from ..arguments import packing_fields, parse_buckets, parse_budget
from ..auth import API_KEY_ENV, key_digest
from ..engine_config import EngineConfig

__all__ = ["ClusterOptions", "build", "build_application"]

APP_NAME = "ort-kvlayout"


@dataclass(frozen=True)
class ClusterOptions:
    """What `ort-kvlayout serve --replicas` and the Serve config's `args` say. The engine's
    fields are the CLI's: kv_budget as --kv-budget (bytes such as 2GiB or a fraction of free
    memory), decode_buckets as --decode-buckets ("1,2,4,8"). replicas: a fixed count, unless
    min_replicas or max_replicas is given (autoscaling; min defaults to 1, max to min).
    threads: intra-op threads per CPU replica (None: cores // the most replicas, at least 1).
    drain_timeout: seconds a stopping replica's requests may run. stats_period: seconds
    between a replica's stats reports (routing, /metrics). stream_interval: seconds a replica
    gathers a stream's tokens into one message after its first (replica.py says why; 0: each
    step's alone). ingress_replicas: HTTP ingress replicas (None: 1 on the CPU, on CUDA the
    most engine replicas; the module docstring says why)."""

    model_dir: str
    model_id: str | None = None
    provider: str = "cpu"
    max_batch: int = 8
    capacity: int | None = None
    kv_budget: str | None = None
    cache: str = "growable"
    prefill_chunk: int | None = None  # None: EngineConfig's default for the provider
    cuda_graph: bool | None = None
    decode_buckets: str | None = None
    packing: str = "auto"
    max_waiting: int = 256
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    threads: int | None = None
    gpus_per_replica: float = 1.0
    ingress_replicas: int | None = None
    drain_timeout: float = 30.0
    stats_period: float = 0.5
    stream_interval: float = 0.05
    metrics_auth: bool = False

    @classmethod
    def from_args(cls, args: dict) -> ClusterOptions:
        """From a Serve config's `args` (a mapping), refusing keys it does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; known: {sorted(known)}")
        if "model_dir" not in args:
            raise ValueError("model_dir is required")
        return cls(**args)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        lo, hi = self.replica_range
        if self.autoscaling and not 1 <= lo <= hi:
            raise ValueError(f"autoscaling needs 1 <= min_replicas <= max_replicas, got {lo}, {hi}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.ingress_replicas is not None and self.ingress_replicas < 1:
            raise ValueError(f"ingress_replicas must be >= 1, got {self.ingress_replicas}")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ValueError(
                f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}"
            )
        if not 0 < self.gpus_per_replica:
            raise ValueError(f"gpus_per_replica must be > 0, got {self.gpus_per_replica}")
        if self.drain_timeout < 0 or self.stats_period <= 0 or self.stream_interval < 0:
            raise ValueError("drain_timeout and stream_interval must be >= 0, stats_period > 0")
        if self.provider == "cuda" and self.gpus_per_replica < 1 and self.budget[0] is None:
            raise ValueError(
                f"replicas sharing a GPU (gpus_per_replica {self.gpus_per_replica}) need "
                "kv_budget in bytes: a share of the free memory depends on which one starts first"
            )
        self.engine_config()  # EngineConfig's own checks, here rather than in each replica

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def replica_range(self) -> tuple[int, int]:
        """(fewest, most) replicas."""
        if not self.autoscaling:
            return self.replicas, self.replicas
        lo = self.min_replicas if self.min_replicas is not None else 1
        return lo, self.max_replicas if self.max_replicas is not None else lo

    @property
    def ingress_count(self) -> int:
        """HTTP ingress replicas (ingress_replicas, or its default)."""
        if self.ingress_replicas is not None:
            return self.ingress_replicas
        return 1 if self.provider == "cpu" else self.replica_range[1]

    @property
    def budget(self) -> tuple[int | None, float | None]:
        if self.kv_budget is None:
            return None, None
        try:
            return parse_budget(str(self.kv_budget))
        except ArgumentTypeError as exc:
            raise ValueError(f"kv_budget {exc}") from None

    def engine_config(self) -> dict:
        """EngineConfig's fields (checked by EngineConfig itself)."""
        budget_bytes, budget_fraction = self.budget
        buckets = None
        if self.decode_buckets is not None:
            try:
                buckets = parse_buckets(str(self.decode_buckets))
            except ArgumentTypeError as exc:
                raise ValueError(f"decode_buckets {exc}") from None
        fields = {
            "max_batch": self.max_batch, "capacity": self.capacity,
            "kv_budget_bytes": budget_bytes, "kv_budget_fraction": budget_fraction,
            "prefill_chunk": self.prefill_chunk, "max_waiting": self.max_waiting,
            "provider": self.provider, "cache": self.cache, "cuda_graph": self.cuda_graph,
            "decode_buckets": buckets, **packing_fields(self.packing),
        }  # fmt: skip
        EngineConfig(**fields)
        return fields

    def replica_threads(self, cores: int | None = None) -> int | None:
        if self.provider != "cpu":
            return self.threads
        if self.threads is not None:
            return self.threads
        return max(1, (cores or os.cpu_count() or 1) // self.replica_range[1])


def _router_config(opts: ClusterOptions) -> dict:
    return {
        "request_router_class": "ort_kvlayout.serve.cluster.router:KvLoadRouter",
        "request_routing_stats_period_s": opts.stats_period,
        "request_routing_stats_timeout_s": max(5.0, 4 * opts.stats_period),
    }


def replica_options(opts: ClusterOptions, cores: int | None = None) -> dict:
    """EngineReplica's deployment options (see the module docstring)."""
    cores = cores or os.cpu_count() or 1
    lo, hi = opts.replica_range
    if opts.provider == "cpu":
        threads = opts.replica_threads(cores)
        actor = {"num_cpus": threads if threads * hi <= cores else cores / hi}
    else:
        actor = {"num_cpus": 1, "num_gpus": opts.gpus_per_replica}
    options = {
        "max_ongoing_requests": opts.max_batch + opts.max_waiting + 1,
        "ray_actor_options": actor,
        "graceful_shutdown_timeout_s": opts.drain_timeout,
        "graceful_shutdown_wait_loop_s": 0.5,
        "request_router_config": _router_config(opts),
    }
    if opts.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": lo,
            "initial_replicas": lo,
            "max_replicas": hi,
            "target_ongoing_requests": opts.target_ongoing_requests or opts.max_batch,
        }
    else:
        options["num_replicas"] = opts.replicas
    return options


def ingress_options(opts: ClusterOptions) -> dict:
    """OpenAIIngress's options: `ingress_count` replicas, each waiting on the engine replicas
    (no CPU reserved) and taking every request they can hold (Ray's default of 5 ongoing would
    cap the whole cluster; HAProxy need not spread the connections evenly)."""
    hi = opts.replica_range[1]
    return {
        "num_replicas": opts.ingress_count,
        "max_ongoing_requests": max(100, hi * (opts.max_batch + opts.max_waiting + 1)),
        "ray_actor_options": {"num_cpus": 0},
        "graceful_shutdown_timeout_s": opts.drain_timeout,
        "graceful_shutdown_wait_loop_s": 0.5,
    }


def build_application(opts: ClusterOptions, api_key: str | None = None, cores: int | None = None):
    """The Serve application (not yet running): serve.run(it, name=APP_NAME, route_prefix="/")."""
    from ray import serve

    from ...runtime.model_spec import ModelSpec
    from .ingress import OpenAIIngress
    from .replica import EngineReplica

    model_dir = Path(opts.model_dir).expanduser().resolve()
    if not (model_dir / "genai_config.json").is_file():
        raise ValueError(
            f"{model_dir}: no genai_config.json (not an onnxruntime-genai model folder)"
        )
    # The model's metadata checked here, once, not by each replica as Ray retries it: a
    # MetadataError (a ValueError) names the key and its rule.
    ModelSpec.from_dir(model_dir)
    engine = serve.deployment(EngineReplica).options(**replica_options(opts, cores))
    ingress = serve.deployment(OpenAIIngress).options(**ingress_options(opts))
    threads = opts.replica_threads(cores)
    digest = key_digest(api_key) if api_key else None
    if opts.metrics_auth and digest is None:
        raise ValueError(f"metrics_auth needs a key (${API_KEY_ENV})")
    return ingress.bind(
        engine.bind(str(model_dir), opts.engine_config(), threads, opts.stream_interval),
        str(model_dir), opts.model_id or model_dir.name, digest, opts.metrics_auth,
    )  # fmt: skip


def build(args: dict):
    """The application builder of a Serve config (`import_path:
    ort_kvlayout.serve.cluster.app:build`): `args` as ClusterOptions; the API key from
    $ORT_KVLAYOUT_API_KEY where Serve builds the application (the cluster's environment)."""
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty (unset it to serve without a key)")
    return build_application(ClusterOptions.from_args(dict(args)), key)
