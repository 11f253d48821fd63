"""Routing by the engines' own load: a Ray Serve request router (`ray.serve.request_router`).

Each engine replica reports its stats through `record_routing_stats` (Ray's controller polls
it every `request_routing_stats_period_s` and hands the result to every router, on
`RunningReplica.routing_stats`). Between two polls the router also knows, live, how many
requests it has sent to each replica and not seen finish (Ray's queue-length cache). A request
goes to the first replica in this order:

1. one that can admit it now: a free slot (its ongoing requests below `max_batch`) and free KV
   budget (budget minus committed bytes) for the request's prompt plus max_tokens;
2. fewest waiting (ongoing requests beyond its slots, or the waiting count it reported);
3. fewest ongoing requests (spreads a burst instead of filling one replica first);
4. most free KV budget;

ties broken at random (idle replicas share single requests).

Ray tries the replicas in that order and takes the first whose `max_ongoing_requests` is not
reached, probing it if its count is unknown. `prefer()` is the hook for prefix-aware routing:
a subclass may move the replica that holds a prompt's long prefix ahead when its load allows.

/metrics reads the same stats: registry.router_for finds this process's router of a deployment
(the ingress holds one per engine deployment). Ray ships this module by value (cloudpickle) to
every process that routes: it keeps no state of its own, and imports what it needs inside
functions by absolute name.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

__all__ = ["KvLoadRouter", "load_key", "request_need"]


def request_need(pending: PendingRequest | None) -> int:
    """Tokens the request may hold in its slot: prompt plus max_tokens (0 if not a generate
    call: generate(prompt, params) is the only call routed by load)."""
    if pending is None or len(pending.args) < 2:
        return 0
    prompt, params = pending.args[0], pending.args[1]
    try:
        return len(prompt) + int(params.max_tokens)
    except (TypeError, AttributeError):
        return 0


def load_key(stats: dict, ongoing: int | None, need_tokens: int, max_ongoing: int) -> tuple:
    """The sort key of a replica (smaller: better) for a request of `need_tokens` tokens, from
    its last reported `stats` (record_routing_stats) and the requests sent to it and not
    finished (`ongoing`, None when unknown)."""
    slots = int(stats.get("max_batch", max_ongoing))
    reported_waiting = int(stats.get("waiting", 0))
    if ongoing is None:  # not sent to lately: what the replica last reported
        ongoing = int(stats.get("running", 0)) + reported_waiting
    waiting = max(ongoing - slots, reported_waiting)
    free_kv = int(stats.get("kv_budget_bytes", 0)) - int(stats.get("kv_committed_bytes", 0))
    admits = ongoing < slots and free_kv >= need_tokens * float(stats.get("kv_bytes_per_token", 0))
    return (not admits, waiting, ongoing, -free_kv)


class KvLoadRouter(RequestRouter):
    """See the module docstring."""

    def initialize_state(self, **kwargs) -> None:
        if kwargs:
            raise ValueError(f"KvLoadRouter takes no request_router_kwargs, got {sorted(kwargs)}")
        from ort_kvlayout.serve.cluster.registry import register

        register(self._deployment_id.app_name, self._deployment_id.name, self)

    def load(self, replica: RunningReplica, need_tokens: int = 0) -> tuple:
        """load_key of `replica`, with Ray's live count of its ongoing requests."""
        ongoing = self.replica_queue_len_cache.get(replica.replica_id)
        return load_key(
            replica.routing_stats or {}, ongoing, need_tokens, replica.max_ongoing_requests
        )

    def prefer(
        self, ranked: list[RunningReplica], pending: PendingRequest | None
    ) -> list[RunningReplica]:
        """The hook for prefix-aware routing: reorder `ranked` (best first by load) for this
        request, e.g. by the prompt's prefix (`pending.args[0]`, its token ids). Load only
        here."""
        return ranked

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        need = request_need(pending_request)
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))  # ties at random
        ranked = sorted(shuffled, key=lambda r: self.load(r, need))
        return [[r] for r in self.prefer(ranked, pending_request)]
