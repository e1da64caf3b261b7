"""Prometheus metrics of the front-end; every name starts with ``elasticep_``.

Each :class:`FrontendMetrics` owns its registry, so several servers (tests) can live in
one process without clashing on metric names.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from elasticep.membership.status import StoreStatus

# Stream gaps after a failure are expected between ~10 ms and a few seconds.
_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class FrontendMetrics:
    """All front-end metrics, registered in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("elasticep_requests", "Finished HTTP generation requests",
                                ["endpoint", "outcome"], registry=r)
        self.requests_running = Gauge("elasticep_requests_running",
                                      "Generation requests in flight", registry=r)
        self.prompt_tokens = Counter("elasticep_prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.generation_tokens = Counter("elasticep_generation_tokens",
                                         "Generated tokens delivered to clients", registry=r)
        self.epoch = Gauge("elasticep_epoch", "Membership epoch", registry=r)
        self.slots = Gauge("elasticep_slots", "Slots of the capacity (--max-ep-size) per "
                           "state; free = unused capacity", ["state"], registry=r)
        self.active_ranks = Gauge("elasticep_active_ranks", "Ranks in state healthy",
                                  registry=r)
        self.membership_store_ok = Gauge(
            "elasticep_membership_store_ok", "1 while the newest membership is committed "
            "to --membership-store (etcd), 0 while it cannot be; absent when embedded",
            registry=r)
        self.membership_store_revision = Gauge(
            "elasticep_membership_store_revision",
            "Store revision of the coordinator's last commit (etcd)", registry=r)
        self.coordinator_leader = Gauge(
            "elasticep_coordinator_leader", "1 for the coordinator replica that holds the "
            "leader lease (etcd)", ["replica"], registry=r)
        self.rank_failures = Counter("elasticep_rank_failures",
                                     "Ranks seen entering state failed", registry=r)
        self.rank_recoveries = Counter("elasticep_rank_recoveries",
                                       "Failed ranks seen healthy again", registry=r)
        self.resubmitted_requests = Counter("elasticep_resubmitted_requests",
                                            "Requests moved to another rank", registry=r)
        self.interruption_seconds = Histogram(
            "elasticep_interruption_seconds",
            "Longest token gap a moved request saw across its move (seconds)",
            buckets=_GAP_BUCKETS, registry=r)

        def rank_gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["rank"], registry=r)

        self.cuda_graph_captures = rank_gauge(
            "elasticep_cuda_graph_captures",
            "Decode CUDA graph captures of a rank since it started (start-up included; "
            "a re-capture after a membership change adds one)")
        self.cuda_graph_replays = rank_gauge(
            "elasticep_cuda_graph_replays",
            "Forwards a rank replayed from a decode CUDA graph since it started (an idle EP "
            "rank's empty steps included)")
        self.decode_replays = rank_gauge(
            "elasticep_decode_replays",
            "Decode steps (every sequence decodes one token) a rank replayed from a CUDA "
            "graph since it started")
        self.decode_eager = rank_gauge(
            "elasticep_decode_eager",
            "Decode steps a rank ran eagerly (no graph, a stale or too small one) since it "
            "started")
        self.rank_steps = rank_gauge("elasticep_rank_steps",
                                     "Committed steps of a rank since it started")
        self.time_to_first_token_seconds = Histogram(
            "elasticep_time_to_first_token_seconds", "Time to first token (seconds)",
            registry=r)

    def rank_stats(self, rank: int, steps: int, captures: int, replays: int,
                   decode_replays: int = 0, decode_eager: int = 0) -> None:
        """Record a rank's counters (a :class:`~elasticep.frontend_link.RankStats`); a
        rank without graphs (-1) exports no graph series, its decode steps all the same."""
        label = str(rank)
        self.rank_steps.labels(rank=label).set(steps)
        self.decode_replays.labels(rank=label).set(decode_replays)
        self.decode_eager.labels(rank=label).set(decode_eager)
        if captures >= 0:
            self.cuda_graph_captures.labels(rank=label).set(captures)
            self.cuda_graph_replays.labels(rank=label).set(replays)

    def store_status(self, store: StoreStatus | None) -> None:
        """Record the membership store's state (None, the embedded default: nothing)."""
        if store is None:
            return
        self.membership_store_ok.set(int(store.ok))
        self.membership_store_revision.set(store.revision)
        self.coordinator_leader.clear()
        if store.leader is not None:
            self.coordinator_leader.labels(store.leader).set(1)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
