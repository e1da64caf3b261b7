"""Prometheus metrics of the front-end; every name starts with ``elasticep_``.

Each :class:`FrontendMetrics` owns its registry, so several servers (tests) can live in
one process without clashing on metric names. Names follow Prometheus' conventions:
durations in ``_seconds`` histograms, counters exposed as ``_total``. The phases of a
death, a rejoin and a scale come from ``recovery_timeline`` events (:meth:`observe`), the
same events ``--event-log`` writes.

Under ``serve --api-server-count N`` (N > 1) the node's front-end processes share their
values through prometheus-client's multiprocess mode (:func:`enable_multiprocess`, one
directory per ``serve``): counters and histograms add up over every process, the node's
ones included that died since; ``elasticep_requests_running`` and
``elasticep_num_queue_reqs`` add up over the live processes; every other gauge (each
process sees the same membership) shows the most recent value a live process set.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from elasticep.membership.status import StoreStatus
from elasticep.membership.transitions import SlotState

# Stream gaps after a failure are expected between ~10 ms and a few seconds.
_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# phases of a recovery, a rejoin (weights load for minutes) and a scale
_PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                  600.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# recovery_timeline event -> (histogram attribute, its label)
_PHASES = {"death_detected": ("death_phase_seconds", "detected"),
           "death_agreed": ("death_phase_seconds", "agreed"),
           "death_placement_repaired": ("death_phase_seconds", "placement_repaired"),
           "death_first_token": ("death_phase_seconds", "first_token"),
           "rejoin_loaded": ("rejoin_phase_seconds", "loaded"),
           "rejoin_admitted": ("rejoin_phase_seconds", "admitted"),
           "rejoin_pause": ("rejoin_phase_seconds", "pause")}


# Gauges every process sets alike, and those a process sets for its own requests
_gauge = partial(Gauge, multiprocess_mode="livemostrecent")
_gauge_sum = partial(Gauge, multiprocess_mode="livesum")

# The directory of this process's multiprocess values, or None (one process: the default).
_multiproc_dir: str | None = None


def enable_multiprocess(directory: str) -> None:
    """Keep the values of every metric created from now on in ``directory`` (shared by
    the node's front-end processes; :class:`FrontendMetrics` then renders their sum).
    Call it in each process before its :class:`FrontendMetrics` exists."""
    global _multiproc_dir
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    # read once at import by prometheus-client: made again now that the directory is set
    values.ValueClass = values.get_value_class()
    _multiproc_dir = directory


def process_died(pid: int) -> None:
    """Drop the live gauges of a dead front-end process (its counters stay: they are
    part of the node's totals)."""
    if _multiproc_dir is not None:
        mark_process_dead(pid, _multiproc_dir)


class FrontendMetrics:
    """All front-end metrics, registered in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._series: dict[int, set[tuple[str, ...]]] = {}  # id(gauge) -> labels set
        r = self.registry
        self.requests = Counter("elasticep_requests", "Finished HTTP generation requests",
                                ["endpoint", "outcome"], registry=r)
        self.requests_running = _gauge_sum("elasticep_requests_running",
                                      "Generation requests in flight", registry=r)
        self.prompt_tokens = Counter("elasticep_prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.generation_tokens = Counter("elasticep_generation_tokens",
                                         "Generated tokens delivered to clients", registry=r)
        self.epoch = _gauge("elasticep_epoch", "Membership epoch", registry=r)
        self.slots = _gauge("elasticep_slots", "Slots of the capacity (--max-ep-size) per "
                           "state; free = unused capacity", ["state"], registry=r)
        self.active_ranks = _gauge("elasticep_active_ranks", "Ranks in state healthy",
                                  registry=r)
        self.membership_store_ok = _gauge(
            "elasticep_membership_store_ok", "1 while the newest membership is committed "
            "to --membership-store (etcd), 0 while it cannot be; absent when embedded "
            "(a labelled gauge has no sample until it is set)", ["store"], registry=r)
        self.membership_store_revision = _gauge(
            "elasticep_membership_store_revision",
            "Store revision of the coordinator's last commit (etcd)", ["store"], registry=r)
        self.coordinator_leader = _gauge(
            "elasticep_coordinator_leader", "1 for the coordinator replica that holds the "
            "leader lease (etcd)", ["replica"], registry=r)
        self.coordinator_replicas = _gauge(
            "elasticep_coordinator_replica", "1 for each coordinator replica, leader or "
            "standby, announced in etcd", ["replica"], registry=r)
        self.frontends = _gauge(
            "elasticep_frontend", "1 for each front-end (a node's HTTP API) announced in "
            "etcd; the ranks answer every one", ["frontend", "url"], registry=r)
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
            return _gauge(name, doc, ["rank"], registry=r)

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
        self.prefill_replays = rank_gauge(
            "elasticep_prefill_replays",
            "Steps with prefill tokens a rank replayed from a decode CUDA graph, one row a "
            "token, since it started")
        self.rank_steps = rank_gauge("elasticep_rank_steps",
                                     "Committed steps of a rank since it started")
        self.time_to_first_token_seconds = Histogram(
            "elasticep_time_to_first_token_seconds", "Time to first token (seconds)",
            registry=r)
        self.e2e_request_latency_seconds = Histogram(
            "elasticep_e2e_request_latency_seconds",
            "From an HTTP request's submission to its last token, once per request (all "
            "its n choices and prompts) (seconds)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token_seconds = Histogram(
            "elasticep_time_per_output_token_seconds",
            "A request's time per output token after its first (seconds)",
            buckets=_TPOT_BUCKETS, registry=r)
        self.num_queue_reqs = _gauge_sum("elasticep_num_queue_reqs",
                                    "Requests waiting for a rank with room", registry=r)
        self.requests_resumed = Counter(
            "elasticep_requests_resumed",
            "Requests moved off a rank with their tokens so far, to go on on another; "
            "cause = failure (the rank died), unreachable (its channel broke) or drain "
            "(it is leaving)", ["cause"], registry=r)
        self.death_phase_seconds = Histogram(
            "elasticep_death_phase_seconds",
            "Phases of a rank's death as the front-end saw them (seconds): detected (its "
            "last step output to the slot shown failed), then from that moment agreed "
            "(the survivors' new epoch), placement_repaired (their first step in it), "
            "first_token (the first token after it)", ["phase"],
            buckets=_PHASE_BUCKETS, registry=r)
        self.rejoin_phase_seconds = Histogram(
            "elasticep_rejoin_phase_seconds",
            "Phases of a rank's rejoin (seconds): loaded (joining to ready), admitted "
            "(ready to healthy), pause (the gap in step outputs across its admission)",
            ["phase"], buckets=_PHASE_BUCKETS, registry=r)
        self.scale_seconds = Histogram(
            "elasticep_scale_seconds",
            "From an accepted scale request to its scale phase idle (seconds); kind = "
            "grow, shrink or retire (a grow superseded or timed out while it waited, and "
            "a request for the current size, are not observed)", ["kind"], buckets=_PHASE_BUCKETS,
            registry=r)
        self.rank_state = _gauge("elasticep_rank_state",
                                "1 for the state each rank (slot) is in, 0 for the others",
                                ["rank", "state"], registry=r)
        self.rank_node = _gauge("elasticep_rank_node", "The node of each rank's last launch",
                               ["rank"], registry=r)
        self.rank_experts_held = _gauge(
            "elasticep_rank_experts_held",
            "Expert slots of a rank that hold an expert (the most over MoE layers), as it "
            "last reported", ["rank"], registry=r)

    def rank_stats(self, rank: int, steps: int, captures: int, replays: int,
                   decode_replays: int = 0, decode_eager: int = 0,
                   prefill_replays: int = 0) -> None:
        """Record a rank's counters (a :class:`~elasticep.frontend_link.RankStats`); a
        rank without graphs (-1) exports no graph series, its decode steps all the same."""
        label = str(rank)
        self.rank_steps.labels(rank=label).set(steps)
        self.decode_replays.labels(rank=label).set(decode_replays)
        self.decode_eager.labels(rank=label).set(decode_eager)
        self.prefill_replays.labels(rank=label).set(prefill_replays)
        if captures >= 0:
            self.cuda_graph_captures.labels(rank=label).set(captures)
            self.cuda_graph_replays.labels(rank=label).set(replays)

    def observe(self, event: Any) -> None:
        """Observe a ``recovery_timeline.Event`` that ends a phase (others are ignored)."""
        if event.seconds is None:
            return
        if event.name == "scale_done":
            self.scale_seconds.labels(event.attrs.get("kind", "unknown")).observe(
                event.seconds)
            return
        target = _PHASES.get(event.name)
        if target is not None:
            getattr(self, target[0]).labels(target[1]).observe(event.seconds)

    def ranks(self, entries: Any) -> None:
        """Set the per-rank gauges from the status' ``RankStatus`` entries."""
        for e in entries:
            label = str(e.rank)
            for state in SlotState:
                self.rank_state.labels(label, state.value).set(float(e.state == state))
            self.rank_node.labels(label).set(-1 if e.node is None else e.node)

    def store_status(self, store: StoreStatus | None) -> None:
        """Record the membership store's state (None, the embedded default: nothing)."""
        if store is None:
            return
        self.membership_store_ok.labels(store.kind).set(int(store.ok))
        self.membership_store_revision.labels(store.kind).set(store.revision)
        self._replace(self.coordinator_leader,
                      {(store.leader,): 1.0} if store.leader is not None else {})

    def directory(self, frontends: dict[str, str], replicas: list[str]) -> None:
        """Record the announced front-ends (name -> URL) and coordinator replicas
        (their addresses), replacing the last ones."""
        self._replace(self.frontends,
                      {(name, url): 1.0 for name, url in frontends.items()})
        self._replace(self.coordinator_replicas, {(address,): 1.0 for address in replicas})

    def _replace(self, gauge: Gauge, series: dict[tuple[str, ...], float]) -> None:
        """Make ``series`` (label values -> value) the labelled gauge's only series. In
        multiprocess mode a series cannot be removed (its last value stays in the
        process's file), so one no longer listed is set to 0 there instead."""
        shown = self._series.get(id(gauge), set())
        for labels in shown - set(series):
            if _multiproc_dir is None:
                gauge.remove(*labels)
            else:
                gauge.labels(*labels).set(0)
        for labels, value in series.items():
            gauge.labels(*labels).set(value)
        self._series[id(gauge)] = set(series)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        if _multiproc_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        node = CollectorRegistry()
        MultiProcessCollector(node, path=_multiproc_dir)
        return generate_latest(node), CONTENT_TYPE_LATEST
