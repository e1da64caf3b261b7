"""The deployment's HTTP front-ends, coordinator replicas and rank processes, announced
in etcd (``--membership-store etcd://``).

Every node's ``serve`` runs a front-end; each one puts a key
``/elasticep/<prefix>/frontends/<name>`` (its link endpoints and URL, as JSON) under an
etcd lease of its own. The ranks list these keys and keep one link per front-end; a
front-end that dies stops renewing its lease, etcd deletes its key after the TTL, and
the ranks drop its link. Each coordinator replica puts ``replicas/<address>`` the same
way, so ``/elastic_ep_status`` can show the standbys too, and each rank process puts
``ranks/<rank>`` (its pid), so that a new leader fails at once the members whose process
is gone (``takeover.py``). See docs/design/ha_membership.md ("A front-end on every node",
"Standby coordinators and failover").

    reg = Announcement(store, FRONTENDS, "node1", {"request_addr": ..., ...}, ttl_s=2)
    reg.start()                       # puts the key, then keeps its lease alive
    list_entries(store, FRONTENDS)    # {"node0": {...}, "node1": {...}}
    reg.close()                       # revokes the lease: the key goes at once
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import MembershipStoreError

if TYPE_CHECKING:  # etcd's client is imported only where etcd is asked for
    from .etcd_store import EtcdMembershipStore

log = logging.getLogger("elasticep.membership")

FRONTENDS = "frontends/"
REPLICAS = "replicas/"
RANKS = "ranks/"


def _prefix_end(prefix: str) -> str:
    """etcd's ``range_end`` for every key starting with ``prefix`` (its last byte + 1)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def list_entries(store: EtcdMembershipStore, directory: str) -> dict[str, dict[str, Any]]:
    """Every entry of ``directory`` (:data:`FRONTENDS`, :data:`REPLICAS`, :data:`RANKS`) under
    ``store``'s prefix: name -> what it announced. A value that is not a JSON object is
    skipped (logged).

    Raises:
        StoreUnavailableError: no etcd member answered.
    """
    return {name: info for name, (info, _lease) in list_leased(store, directory).items()}


def list_leased(store: EtcdMembershipStore,
                directory: str) -> dict[str, tuple[dict[str, Any], int]]:
    """As :func:`list_entries`, with the id of the lease each entry's key is under
    (0: none): name -> (what it announced, lease)."""
    from .etcd_store import b64, unb64

    prefix = store.key(directory)
    out = store.kv.post("kv/range", {"key": b64(prefix), "range_end": b64(_prefix_end(prefix))})
    found: dict[str, tuple[dict[str, Any], int]] = {}
    for kv in out.get("kvs") or []:
        name = unb64(kv["key"]).decode()[len(prefix):]
        try:
            value = json.loads(unb64(kv.get("value", "")))
        except ValueError:
            value = None
        if not isinstance(value, dict):
            log.warning("%s: skipping %s (not a JSON object)", prefix, name)
            continue
        found[name] = (value, int(kv.get("lease", 0)))
    return found


class Announcement:
    """One process's key in a directory, held by a lease this object keeps alive.

    If the lease is lost (etcd was out of reach longer than the TTL), the key is put
    again under a fresh lease at the next keep-alive etcd answers: a process that
    lives is listed again once etcd is back.

    Args:
        store: the deployment's etcd store.
        directory: :data:`FRONTENDS`, :data:`REPLICAS` or :data:`RANKS`.
        name: the entry's name, unique in the directory (``node<K>`` for a front-end,
            the control address for a replica, the global rank for a rank).
        info: what it announces (JSON-able). A front-end: ``request_addr``,
            ``output_addr`` (its link's zmq endpoints), ``url`` (its HTTP API) and
            ``node``; a replica: ``address`` and ``pid``; a rank: ``rank``, ``pid`` and
            ``host`` (the address it reaches the coordinator from).
        ttl_s: lease TTL in whole seconds (``election.lease_ttl_s``).
    """

    def __init__(self, store: EtcdMembershipStore, directory: str, name: str,
                 info: dict[str, Any], ttl_s: int) -> None:
        self.store, self.name, self.info, self.ttl_s = store, name, info, ttl_s
        self._key = store.key(directory + name)
        self._lease: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, required: bool = True) -> None:
        """Put the key now, then keep it alive on a daemon thread (which puts it, should
        this first put fail with ``required`` False).

        Raises:
            MembershipStoreError: etcd did not take the key (``required`` only).
        """
        try:
            self._put()
        except MembershipStoreError as e:
            if required:
                raise
            log.warning("%s not announced yet: %s", self._key, e)
        self._thread = threading.Thread(target=self._keep_alive, daemon=True,
                                        name=f"lease-{self.name}")
        self._thread.start()
        log.info("%s announced", self._key)

    def _put(self) -> None:
        from .etcd_store import b64

        lease = int(self.store.kv.post("lease/grant", {"TTL": self.ttl_s, "ID": 0})["ID"])
        self.store.kv.post("kv/put", {"key": b64(self._key),
                                      "value": b64(json.dumps(self.info)), "lease": lease})
        self._lease = lease

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self._lease is None:
                    self._put()
                    log.warning("%s announced again (its lease had expired)", self._key)
                    continue
                out = self.store.kv.post("lease/keepalive", {"ID": self._lease})
                if int(out.get("result", {}).get("TTL", -1)) <= 0:
                    self._lease = None  # expired: put again at the next period
            except MembershipStoreError as e:
                log.debug("%s: lease keep-alive: %s", self._key, e)

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease (the key goes now, not a TTL later);
        best effort: an unreachable etcd lets it expire on its own."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self.store.kv.post("kv/lease/revoke", {"ID": lease})
            except MembershipStoreError:
                pass


def directory_reader(url: str) -> Callable[[], dict[str, dict[str, Any]]]:
    """A call that lists the front-ends under ``url`` (``etcd://...``; see
    :func:`list_entries`), over one store kept open for the caller's lifetime."""
    from .etcd_store import EtcdMembershipStore
    from .store import parse_store_url

    store = EtcdMembershipStore(parse_store_url(url))
    return lambda: list_entries(store, FRONTENDS)


def announce_rank(url: str, rank: int, ttl_s: int, host: str) -> Announcement:
    """Put ``ranks/<rank>`` (this process's pid, and ``host``, the address it reaches the
    coordinator from) under ``url`` (``etcd://...``) with a lease of ``ttl_s`` whole
    seconds that this process keeps alive while it lives: a leader that takes over fails
    at once a member whose key is gone or whose lease ran out
    (``membership/takeover.py``, ``lease_watch.LiveRanks``). An etcd that does not answer
    now is not fatal: the key is put at the first keep-alive it answers."""
    from .etcd_store import EtcdMembershipStore
    from .store import parse_store_url

    entry = Announcement(EtcdMembershipStore(parse_store_url(url)), RANKS, str(rank),
                         {"rank": rank, "pid": os.getpid(), "host": host}, ttl_s)
    entry.start(required=False)
    return entry


def rank_processes(store: EtcdMembershipStore) -> dict[int, int]:
    """Global rank -> pid of every rank process whose key (:func:`announce_rank`) is in
    etcd under ``store``'s prefix: the ranks whose lease is still kept alive. An entry
    without an integer ``rank`` and ``pid`` is skipped (logged).

    Raises:
        StoreUnavailableError: no etcd member answered.
    """
    return {rank: pid for rank, (pid, _lease, _host) in rank_entries(store).items()}


def rank_entries(store: EtcdMembershipStore) -> dict[int, tuple[int, int, str | None]]:
    """As :func:`rank_processes`: global rank -> (pid, the id of its key's lease, the
    host it announced or None)."""
    out: dict[int, tuple[int, int, str | None]] = {}
    for name, (info, lease) in list_leased(store, RANKS).items():
        try:
            host = info.get("host")
            out[int(info["rank"])] = (int(info["pid"]), lease,
                                      host if isinstance(host, str) else None)
        except (KeyError, TypeError, ValueError):
            log.warning("%s%s: skipping %r (no integer rank and pid)", RANKS, name, info)
    return out
